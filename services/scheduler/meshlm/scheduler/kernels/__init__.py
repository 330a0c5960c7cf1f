"""C kernels for CPUs, compiled at first use with the system C compiler (kernels.build)."""
