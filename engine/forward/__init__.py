"""The model's forward on a CPU, leaner than transformers': sibling projections fused into one
matmul (``fusion``) and a Llama stack's forward from one loop with the compiled layer ops
(``llama``)."""
