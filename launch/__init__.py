"""Launch helpers: torchrun wrappers (``launch/ep.sh``) and an in-process spawner for tests."""
