// The modules of the `vmm_memd` package (python/vmm_memd/), embedded: each as its path under a
// PYTHONPATH directory and its text, for the Rust tests that run the Python client
// (vmm-memd/tests/python_client.rs, examples/tests/memd_demo.rs): a test executable may not
// read the build machine's paths, so they `include!` this one list and write the files out. A
// module missing here fails their first `import vmm_memd` (the package's __init__ imports every
// module). The last entry is the CUDA helper that `vmm_memd.gpu` imports for GPU regions.
[
    (
        "vmm_memd/__init__.py",
        include_str!("vmm_memd/__init__.py"),
    ),
    (
        "vmm_memd/attached.py",
        include_str!("vmm_memd/attached.py"),
    ),
    ("vmm_memd/client.py", include_str!("vmm_memd/client.py")),
    ("vmm_memd/dlpack.py", include_str!("vmm_memd/dlpack.py")),
    ("vmm_memd/errors.py", include_str!("vmm_memd/errors.py")),
    ("vmm_memd/gpu.py", include_str!("vmm_memd/gpu.py")),
    (
        "vmm_memd/keep_alive.py",
        include_str!("vmm_memd/keep_alive.py"),
    ),
    ("vmm_memd/mapping.py", include_str!("vmm_memd/mapping.py")),
    (
        "vmm_memd/postcard.py",
        include_str!("vmm_memd/postcard.py"),
    ),
    (
        "vmm_memd/protocol.py",
        include_str!("vmm_memd/protocol.py"),
    ),
    (
        "vmm_memd/publishing.py",
        include_str!("vmm_memd/publishing.py"),
    ),
    (
        "vmm_memd/service.py",
        include_str!("vmm_memd/service.py"),
    ),
    (
        "vmm_memd/__main__.py",
        include_str!("vmm_memd/__main__.py"),
    ),
    ("vmm_memd/sleep.py", include_str!("vmm_memd/sleep.py")),
    ("vmm_memd/tensor.py", include_str!("vmm_memd/tensor.py")),
    ("vmm_memd/torch.py", include_str!("vmm_memd/torch.py")),
    ("vmm_memd/writer.py", include_str!("vmm_memd/writer.py")),
    ("vmm_ipc_cuda.py", include_str!("vmm_ipc_cuda.py")),
]
