"""The FSDP2 training backend (HF-native, data parallel only): ``backend.FSDPBackend``."""
