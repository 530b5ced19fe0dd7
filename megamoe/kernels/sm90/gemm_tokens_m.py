"""The SM90 grouped GEMM with tokens on the wgmma M side (``GemmConfig(token_side="m")``): ``gemm.GroupedGemmSm90``
with the tokens-on-M mainloop (``mainloop_fp8_tokens_m``) and its epilogue (``epilogues.Bf16StoreTokensM``).

Everything but the consumers' registers is the swap-AB kernel's: the tile order (``tile_tokens`` rows of one group x
``tile_n`` weight rows), the producer warp's TMA loads (tokens [tile_tokens, 128] and the weights' E4M3 copy
[tile_n, 128], both 128-byte swizzled K-major, the folded scale words, the tokens' FP32 scale box), the pipeline and
the tile channel. Only the roles of the two shared-memory tiles in the wgmma change: the tokens are its A (64 rows
per consumer warpgroup: ``config.consumer_warpgroups`` = tile_tokens / 64), the weights its B (N = tile_n), so a
consumer thread holds two token rows and ``tile_n / 4`` weight columns. The epilogue stages each tile's BF16 rows
in shared memory for the TMA unit's row copies (``staged_out``; the stage count leaves room for the tile).

Recipe (1, 1, 128) with the weights' E4M3 copy (decode "copy"), any group mode, no bias (the API checks), and one of
two epilogues: BF16 rows (``out[m, n]``: ``Bf16StoreTokensM``), or L1's per-128 SwiGLU (``swiglu_fp8``:
``SwigluQuant128TokensM``, or with gpt-oss's activation ``SwigluOaiQuant128TokensM``) on 256-row tiles run as two
passes of 128 weight rows (``GemmConfig.n_passes``: the producer loads every K step of the first pass's weights,
then of the second's, each with the tile's tokens), so that one tile holds the 128 intermediate columns of a scale
block; its staging tile holds one pass's FP32 activations (``GemmConfig.act_stride``), and its FP8 rows leave by
the TMA unit too. On two-CTA clusters (``GemmConfig.cluster`` 2): ``ClusterPairTokensMGemmSm90``, the two
CTAs of a weight-tile pair sharing each token tile; on four (``cluster`` 4): ``ClusterQuadTokensMGemmSm90``, a 2 x 2
quad sharing both (``gemm_cluster``).
"""

from __future__ import annotations

from .config import GemmConfig
from .epilogues import Bf16StoreTokensM, SwigluOaiQuant128TokensM, SwigluQuant128TokensM
from .gemm import GroupedGemmSm90
from .gemm_cluster import ClusterPairGemmSm90, ClusterQuadGemmSm90
from .mainloop_fp8_tokens_m import Fp8CopyTokensMMainloop


class TokensMGemmSm90(GroupedGemmSm90):
    """``GroupedGemmSm90`` with tokens on the wgmma M side (module docstring): ``config.token_side`` "m", epilogue
    "bf16" (one pass) or "swiglu_fp8" (two), folded weights."""

    def __init__(self, config: GemmConfig, group_mode: str, epilogue: str = "bf16", folded: bool = True,
                 fast_math: bool = True, activation: str = "swiglu"):
        assert config.token_side == "m" and epilogue in ("bf16", "swiglu_fp8") and folded  # api checks
        assert (epilogue == "swiglu_fp8") == (config.n_passes == 2)  # api checks
        super().__init__(config, group_mode, epilogue, folded, fast_math, activation)

    @property
    def staged_out(self) -> bool:
        """``Bf16StoreTokensM`` stages each tile's BF16 rows for the TMA unit's row copies (the SwiGLU epilogue
        stages in ``sAct``)."""
        return self.epilogue_kind == "bf16"

    def make_mainloop(self, folded: bool):
        return Fp8CopyTokensMMainloop(self.cfg, self.stages, self.cps)

    def make_epilogue(self, epilogue: str, fast_math: bool):
        if epilogue == "swiglu_fp8":
            return (SwigluOaiQuant128TokensM if self.activation == "swiglu_oai" else SwigluQuant128TokensM)(
                self.cfg, fast_math)
        return Bf16StoreTokensM(self.cfg)

    def after_consumers(self, ctidx, sync, groups, mega, ctx, bidx, gdim):
        """The last tile's row copies complete before the CTA exits (the epilogue's ``drain``)."""
        self.epilogue.drain(ctidx)


class ClusterPairTokensMGemmSm90(ClusterPairGemmSm90, TokensMGemmSm90):
    """Tokens on the wgmma M side on two-CTA clusters: ``gemm_cluster``'s tile order and token multicast, this
    module's mainloop and epilogue."""


class ClusterQuadTokensMGemmSm90(ClusterQuadGemmSm90, TokensMGemmSm90):
    """Tokens on the wgmma M side on four-CTA clusters: ``gemm_cluster``'s 2 x 2 quad (token and weight boxes
    multicast), this module's mainloop and epilogue."""
