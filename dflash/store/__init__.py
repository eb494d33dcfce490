"""Caches on object storage (s3://, gs://, az://): URLs, the client, the commit protocol without rename, and
the publish (local cache -> store) and fetch (store -> local mirror folder) paths built on them."""
