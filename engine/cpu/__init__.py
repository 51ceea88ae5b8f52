"""The compiled CPU kernels and what loads them.

``csrc/`` holds the C sources, one library each: decode attention (``decode_attention.c``) and
prefill attention (``prefill_attention.c``) over the paged KV cache, the float32 GEMM
(``sgemm.c``) and the bf16 GEMM (``bgemm.c``) on weights packed once, and the layer ops between
a Llama layer's matmuls with the greedy argmax (``layer_ops.c``); ``batchd.h`` declares every
function and argument struct, ``vector.h`` the sixteen-float vectors they share. ``kernels``
builds them once per machine and loads them, ``abi`` is their ctypes interface, and ``linear``
decides which GEMM each linear layer's weight is packed for."""
