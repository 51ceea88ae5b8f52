"""The compiled CPU kernels: their C sources (``csrc/``, one header), the loader that builds
them once per machine (``kernels``), their ctypes interface (``abi``), and which GEMM each
linear layer's weight is packed for (``linear``)."""
