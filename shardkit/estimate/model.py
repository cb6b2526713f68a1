"""What the estimate needs to know about a model: every parameter's numel and first dimension, which
module owns it, and the sizes the activation estimate reads. Plain data; ``meta_model`` fills it from a
transformers config on the meta device, ``from_count`` from a bare parameter count."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParamShape:
    """One trainable parameter, in ``model.named_parameters()`` order (tied weights once)."""

    name: str
    """Dotted name, e.g. ``model.layers.0.mlp.up_proj.weight``."""
    numel: int
    """Elements of the whole (unsharded) parameter."""
    dim0: int
    """Its first dimension: FSDP2 shards dim 0, so a rank holds ceil(dim0 / world) rows."""
    unit: str
    """The FSDP2 unit it falls in: the wrapped module (``model.layers.3``) or ``""`` for the root."""


@dataclass(frozen=True)
class ModelShape:
    """A model as the estimate sees it."""

    source: str
    """Where it came from, for the report (``config.json at ./llama``, ``6805M parameters``)."""
    total_params: int
    """Trainable parameters (tied weights counted once, as named_parameters() yields them)."""
    params: tuple[ParamShape, ...] = ()
    """Every parameter; empty when only a count is known (persistence and padding are then not exact)."""
    largest_layer_params: int = 0
    """Parameters owned directly by the largest module (DeepSpeed's ``largest_layer_params``): what ZeRO-3
    gathers at once for one module; 0 when unknown."""
    dtype: str = "float32"
    """The dtype the model is built in (``torch_dtype``/``dtype`` of its config, float32 by default)."""
    model_type: str | None = None
    """transformers' model_type (``llama``), None for a bare count."""
    hidden_size: int | None = None
    """Width of the residual stream: the activation estimate and the HF Trainer's "auto" buckets read it."""
    num_layers: int | None = None
    """Decoder layers (num_hidden_layers)."""
    intermediate_size: int | None = None
    """MLP width."""
    vocab_size: int | None = None
    """Vocabulary size: the logits' width."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What was assumed while reading the model."""

    @property
    def exact(self) -> bool:
        """Whether per-parameter shapes are known (persistence, padding and units exact)."""
        return bool(self.params)

    def unit_params(self) -> dict[str, int]:
        """Elements per FSDP2 unit (``""`` is the root's own parameters)."""
        units: dict[str, int] = {}
        for p in self.params:
            units[p.unit] = units.get(p.unit, 0) + p.numel
        return units

    def largest_unit_params(self) -> int:
        """Elements of the largest wrapped unit (a decoder layer); the layer size estimated when unknown."""
        units = {k: v for k, v in self.unit_params().items() if k}
        if units:
            return max(units.values())
        if self.num_layers and self.hidden_size and self.intermediate_size:
            return 4 * self.hidden_size**2 + 3 * self.hidden_size * self.intermediate_size
        return 0

    def root_params(self) -> int:
        """Elements outside every wrapped unit (embeddings, final norm, head): FSDP2's root unit."""
        if self.params:
            return self.unit_params().get("", 0)
        if self.num_layers:
            return max(0, self.total_params - self.num_layers * self.largest_unit_params())
        return 0


def from_count(total_params: int, largest_layer_params: int = 0, dtype: str = "float32") -> ModelShape:
    """A model known only by its parameter count (and, optionally, its largest layer)."""
    notes = [
        "model known by its parameter count only: ZeRO-3's persistent parameters (below "
        "stage3_param_persistence_threshold) are not counted and no padding is added; pass a config.json "
        "for exact per-parameter arithmetic"
    ]
    if not largest_layer_params:
        notes.append("largest layer unknown: the parameters ZeRO-3 gathers for one module are not counted "
                     "(pass --largest-layer N)")
    return ModelShape(source=f"{total_params / 1e6:,.0f}M parameters", total_params=total_params,
                      largest_layer_params=largest_layer_params, dtype=dtype, notes=tuple(notes))
