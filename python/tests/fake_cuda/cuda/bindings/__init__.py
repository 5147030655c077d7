"""A fake of cuda.bindings for python/tests/test_vmm_ipc_cuda.py (no GPU needed)."""
