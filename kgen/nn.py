"""kgen's nn.Modules: `FusedMLP` (a whole MLP in one fused_mlp launch)."""

from kgen.families.fused_mlp.module import FusedMLP

__all__ = ["FusedMLP"]
