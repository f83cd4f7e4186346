"""TVM kernel generators.

`compute` defines what every kernel computes, once (TE definitions and the shared TIR math); `cpu` (dense,
LLVM AVX2 / AVX-512) and `neuron` (PowerInfer's neuron-aware operators, CPU) schedule those definitions for
the CPU or write TVMScript kernels, `cuda` does the same for NVIDIA GPUs; `ops` is the registry that code
requesting kernels uses: one `KernelOp` per kernel with its CPU and CUDA makers.
"""
