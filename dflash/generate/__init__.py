"""Target regeneration (`dflash generate`): batched greedy decoding of the target, whole conversations turn by
turn, resumable sharded output, and an OpenAI-compatible endpoint mode.

Modules: decode (the batched greedy decoder: HF eager generate on CPU, a compiled static-cache decode on CUDA),
conversations (what is regenerated, from data files or prompt files), turns (exact context ids across turns and
the output record), output (shards, commit log, job fingerprint, final merge), run (the driver), endpoint
(requests to a served model).
"""
