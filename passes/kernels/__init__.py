"""TVM kernel generators: `cpu` (dense, LLVM AVX2+FMA) and `neuron` (PowerInfer's neuron-aware operators)."""
