"""Inline-PTX reductions that only the benchmarks compile (``benchmarks/bench_reduce.py`` and issue 26's probes):
4-byte bulk rows (``.add.f32``, ``.add.u32``) and ``red.global.add`` from registers. The backward's own ``.add.u64``
bulk rows and the bulk-group commits and waits are ``sparse_mqa_kernels.backward.PRELUDE``; a kernel that uses
both takes ``PRELUDE + PRELUDE_4B``."""

PRELUDE_4B = "".join(r"""
__device__ __forceinline__ void sparse_mqa_bulk_add_%s(void const* smem, void* gmem, int bytes) {
  unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.%s [%%0], [%%1], %%2;"
               :: "l"(gmem), "r"(s), "r"(bytes) : "memory");
}
""" % (t, t) for t in ("f32", "u32")) + r"""
__device__ __forceinline__ void smqa_red_u32(void* p, int v) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void smqa_red_u64(void* p, long long v) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void smqa_red_f32(void* p, float v) {
  asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" :: "l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void smqa_red_v4_f32(void* p, float a, float b, float c, float d) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
               :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
"""
