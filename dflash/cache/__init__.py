"""The on-disk hidden-state cache: format.py (what it is), writer.py, reader.py, verify.py, commit.py."""

from dflash.cache.commit import committed_sample_ids, open_cache_fingerprint
from dflash.cache.format import (FORMAT_NAME, FORMAT_VERSION, FP8_MAX, STORAGE_DTYPES, Fingerprint,
                                 dequantize_fp8, encode_hidden, quantize_fp8)
from dflash.cache.reader import CacheReader, PackedBuffers, PackedSamples, Sample, SampleIndex
from dflash.cache.writer import CacheWriter, WriteStats

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "FP8_MAX", "STORAGE_DTYPES", "CacheReader", "CacheWriter",
           "Fingerprint", "PackedBuffers", "PackedSamples", "Sample", "SampleIndex", "WriteStats",
           "committed_sample_ids", "dequantize_fp8", "encode_hidden", "open_cache_fingerprint", "quantize_fp8"]
