"""What our TileLang kernels are compiled for: Hopper (sm_90a, for wgmma and the bulk copy engine), also on a
machine without a GPU, where the compile checks and ``precompile`` run."""

TARGET = {"kind": "cuda", "arch": "sm_90a"}
