"""linear_logp's CUDA variants (sm_90a TMA + mbarrier + WGMMA, sm_80 mma.sync): `CudaForward`,
a built variant's C entry points behind the interface `launch` calls -- the forward's
partials and their combine in one launcher call, and on sm_90a the backward's dz kernel --
with their grids (splits, row groups), and the policy of when the backward takes the CUDA
dz kernel (CUDA_DZ). `launch.forward` and `backward_launch.backward` run it; the Triton companion
(`CudaForward.triton`) supplies everything else."""

from __future__ import annotations

import ctypes
import os

import torch

from kgen.families.linear_logp import plans
from kgen.families.linear_logp.plans import GROUP_BYTES, LOG2E, _cdiv, wave_splits
from kgen.families.linear_logp.schema import GEMV_GROUP, _cuda_smem, max_rows
from kgen.runtime.streams import current_raw_stream

# Which dz kernel the backward's chunks run on sm_90a variants without a bias
# (CudaForward.takes_dz): the CUDA one (the forward's WGMMA mainloop with a dz epilogue,
# launched by one C call) or the Triton one. Measured on an H100 (BENCHMARKS.md, thirteenth
# session), the CUDA kernel takes 1.10-1.39x a same-sized GEMM per chunk against the Triton
# kernel's 1.02-1.18x (its epilogue stores dz from registers, 4 bytes a thread), so it runs
# only where a call is host-bound: logits of at most CUDA_DZ_MAX_FLOP (2*N*D*V) -- there a
# Triton launch (~30 us of host time with its TMA descriptors) costs more than the kernel.
# KGEN_LINEAR_LOGP_CUDA_DZ=1 takes it at every size, =0 never.
CUDA_DZ = {"1": "always", "0": "never"}.get(os.environ.get("KGEN_LINEAR_LOGP_CUDA_DZ", ""), "auto")
CUDA_DZ_MAX_FLOP = 2e10


class CudaForward:
    """A CUDA variant (sm_90a WGMMA, sm_80 mma.sync, or the small-N streaming kernel, `gemv`):
    its kernels write the forward partials and combine them; the Triton module `triton`
    supplies the backward and the whole forward for inputs the CUDA kernel cannot take
    (`takes`): another dtype than the variant's, rows that are not whole 16-byte units or a
    pointer not 16-byte aligned (TMA, cp.async and the gemv kernel's loads move 16-byte
    pieces), and for the gemv kernel more than block_m rows. (float32: gemv variants only, on
    TF32 mma.sync, one product with TF32 allowed, three without.)

    The number of splits is chosen per call by wave_splits, with the spec's split_v as the
    minimum, over row groups (the `cluster` row blocks one cluster takes) and the clusters
    the SMs hold at once."""

    def __init__(self, kernel, triton_mod):
        self.kernel, self.triton = kernel, triton_mod
        p = kernel.params
        self.block_m, self.block_n, self.split_v = p["block_m"], p["block_n"], p["split_v"]
        # the small-N streaming kernel (cuda_gemv.cu.j2): one CTA covers all N <= block_m rows
        self.gemv = p.get("kernel") == "gemv"
        self.rows = self.block_m * p.get("cluster", 1)  # rows of hidden per cluster
        # The vocabulary rows a forward split takes at least: a tile; the gemv kernel's CTAs
        # share out 16-row groups (its warps a CTA's steps), so up to one split a group: capped
        # at one a block_n tile, a 3364-row vocabulary ran on 14 of 132 SMs (H200, float32
        # 2 x 3896 x 3364: 101.4 us, 24.6 a split a group; BENCHMARKS.md fifty-fourth session).
        self.split_unit = GEMV_GROUP if self.gemv else self.block_n
        self.max_rows = max_rows(p)  # the most rows its forward takes (None: any)
        self.name = kernel.name
        self.dtype = getattr(torch, kernel.variant.dtype)  # the inputs' dtype its kernels take
        self._resident: dict[int, int] = {}
        self._splits: dict[tuple, int] = {}  # (N, V, device) -> the forward's splits
        self._dz_grids: dict[tuple, tuple[int, int]] = {}  # (N, D, width, device) -> (splits, group)
        # the sm_90a library's second entry point: the backward's dz kernel (DzArgs in the
        # template); None for sm_80 variants, whose backward runs the Triton dz kernel
        lib = getattr(kernel, "lib", None)
        dz = getattr(lib, "kgen_launch_dz", None) if kernel.variant.arch == "sm_90a" else None
        self._dz_ptr = ctypes.cast(dz, ctypes.c_void_p).value if dz is not None else None

    def takes(self, hidden, weight, bias) -> bool:
        if hidden.dtype != self.dtype or hidden.shape[1] * hidden.element_size() % 16:
            return False
        if self.max_rows is not None and hidden.shape[0] > self.max_rows:  # the gemv kernel's
            return False
        # TMA (sm_90a) reads the bias too; the sm_80 kernel reads it element by element.
        tensors = (hidden, weight, bias) if self.kernel.variant.arch == "sm_90a" else (hidden, weight)
        return all(t.data_ptr() % 16 == 0 for t in tensors if t is not None)

    def _clusters(self, device: torch.device) -> int:
        """Clusters of this kernel the GPU holds at once."""
        if device.index not in self._resident:
            props = plans._device_props(device.index)
            self._resident[device.index] = self._ctas_per_sm(props) * props.multi_processor_count
        return self._resident[device.index] * self.block_m // self.rows

    def splits(self, N: int, V: int, device: torch.device) -> int:
        key = (N, V, device.index)
        splits = self._splits.get(key)
        if splits is None:  # (per call: a few us of a host-bound forward)
            if len(self._splits) >= 4096:
                self._splits.clear()
            splits = self._splits[key] = wave_splits(_cdiv(N, self.rows), self.split_v, _cdiv(V, self.split_unit),
                                                     self._clusters(device))
        return splits

    def dz_splits(self, N: int, width: int, device: torch.device) -> int:
        """Splits of a dz chunk `width` columns wide: wave_splits without split_v's minimum
        (the fewest that fill whole waves). Its grouped order keeps the hidden rows and the
        weight tiles of the CTAs resident together within L2. Measured per chunk on an H100
        (BENCHMARKS.md, thirteenth session): 1.11-1.38x a same-sized GEMM; one wave of CTAs
        each sweeping several tiles instead: 1.10-1.39x, and worse at N = 16384 (all of
        hidden re-read every tile)."""
        return wave_splits(_cdiv(N, self.rows), 1, _cdiv(width, self.block_n), self._clusters(device))

    def _ctas_per_sm(self, props) -> int:
        """CTAs of this kernel one SM holds at once, by shared memory and registers."""
        v = self.kernel.variant
        if v.arch == "sm_90a":
            return 1  # __launch_bounds__(threads, 1) and ~225 KB of rings
        smem = _cuda_smem(v.arch, v.dtype, v.params)
        per_sm_smem = getattr(props, "shared_memory_per_multiprocessor", smem)
        resources = self.kernel.entry.manifest.get("resources", {})
        regs = max((r["registers"] for r in resources.values()), default=255)
        threads = 2 * v.params["block_n"] if self.gemv else 128 * v.params["consumers"]  # gemv: a warp a 16 rows
        return max(1, min(per_sm_smem // smem, 65536 // (threads * max(regs, 1)), 2048 // threads))

    def takes_dz(self, hidden, weight, bias) -> bool:
        """Whether the backward's dz pass runs this variant's CUDA dz kernel: sm_90a, no bias
        (the CUDA epilogue writes no column sums for grad_bias), what the forward takes, and
        CUDA_DZ's choice for the size."""
        if self._dz_ptr is None or bias is not None or CUDA_DZ == "never":
            return False
        if CUDA_DZ == "auto" and 2 * hidden.shape[0] * hidden.shape[1] * weight.shape[0] > CUDA_DZ_MAX_FLOP:
            return False
        return self.takes(hidden, weight, None)

    def dz(self, hidden, weight, target, lse2, ez2, g_logp, g_ent, dz, v0: int, v1: int,
           temperature: float, ignore_index: int) -> None:
        """dz[:, :v1 - v0] for the vocabulary chunk [v0, v1) (the contract of the Triton
        linear_logp_bwd_dz_kernel without grad_bias's column sums): ez2 and g_ent None
        without entropy, g_logp None for zeros. dz: a 16-byte aligned view of at least N rows
        (rows from N on untouched) and v1 - v0 columns, with an even row stride."""
        N, D = hidden.shape
        V = weight.shape[0]
        dev = hidden.device
        target = target if target.dtype == torch.int64 else target.long()
        k = self.kernel
        key = (N, D, v1 - v0, dev.index)
        grid = self._dz_grids.get(key)
        if grid is None:  # per call it would cost a few us of a host-bound backward
            grid = self._dz_grids[key] = (self.dz_splits(N, v1 - v0, dev), self.group(N, D))
        rc = k.raw(self._dz_ptr, dev.index, hidden.data_ptr(), weight.data_ptr(), target.data_ptr(),
                   lse2.data_ptr(), ez2.data_ptr() if ez2 is not None else 0,
                   g_logp.data_ptr() if g_logp is not None else 0, g_ent.data_ptr() if g_ent is not None else 0,
                   dz.data_ptr(), dz.stride(0), N, V, D, v0, v1, *grid,
                   current_raw_stream(dev.index), ignore_index, LOG2E / temperature, 1.0 / temperature)
        if rc:
            k.fail(rc)

    def group(self, N: int, D: int) -> int:
        """Row groups (a cluster's row blocks) per group of the CUDA grid order: as many as
        keep the group's hidden rows within GROUP_BYTES of L2 (see the sm_90a template's
        work-order comment)."""
        return max(1, min(_cdiv(N, self.rows), GROUP_BYTES // (self.rows * D * 2)))

    def partials(self, hidden, weight, target, bias, temperature: float, with_entropy: bool, splits: int,
                 outputs=None, ignore_index: int = -100, part=None):
        """The partials part[4, splits, N] (float32; `part`: the buffer to write, else a new
        one); given `outputs` (logp, entropy, lse2, ez2: float32, entropy and ez2 [0]
        without entropy), the kernel's combine fills them in the same launcher call (one host
        call for the whole forward)."""
        N, D = hidden.shape
        V = weight.shape[0]
        dev = hidden.device
        if part is None:
            part = torch.empty((4, splits, N), dtype=torch.float32, device=dev)
        target = target if target.dtype == torch.int64 else target.long()
        outs = tuple(t.data_ptr() for t in outputs) if outputs is not None else (0, 0, 0, 0)
        self.bind_forward(N, V, D, splits, with_entropy, dev)(
            hidden.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else 0, target.data_ptr(),
            part.data_ptr(), *outs, ignore_index, LOG2E / temperature)
        return part

    def bind_forward(self, N: int, V: int, D: int, splits: int, with_entropy: bool, device: torch.device):
        """The forward's launcher call (partials, then the combine where `logp` is not 0)
        with the shape, splits and grid order bound: go(hidden, weight, bias, target, part,
        logp, entropy, lse2, ez2, ignore_index, scale), the tensors as addresses (0: none;
        target int64, the buffers float32 as `partials` describes), scale = log2(e) /
        temperature; on the current stream of `device`. float32 (the gemv kernel): the
        products' precision read per call, exact (3 TF32 products) where TF32 is not allowed
        (plans._precision "tf32x3")."""
        k, index, group = self.kernel, device.index, self.group(N, D)
        raw, ptr, with_entropy = k.raw, k.ptr, bool(with_entropy)
        matmul = torch.backends.cuda.matmul if self.dtype == torch.float32 else None

        def go(hidden, weight, bias, target, part, logp, entropy, lse2, ez2, ignore_index: int, scale: float):
            exact = matmul is not None and not matmul.allow_tf32
            rc = raw(ptr, index, hidden, weight, bias, target, part, N, V, D, splits, group, with_entropy,
                     current_raw_stream(index), logp, entropy, lse2, ez2, ignore_index, int(exact), scale)
            if rc:
                k.fail(rc)
        return go
