"""Modules that hold packed weights: ``QuantLinear``, ``QuantEmbedding`` and the tied ``QuantLMHead``.

``QuantEmbedding.replacing`` keeps an architecture's own embedding class (its forward, e.g. Gemma's
``sqrt(hidden)`` scale, and its buffers): only the source of ``weight`` changes.

Their forward is the reference path: dequantize the packed weight, then a dense matmul (or lookup).
With ``cache=True`` a module keeps its dequantized weight after the first forward (fast repeated
evaluation on CPU, at the memory cost of a dense weight); the packed tensors stay the source of truth.
They are buffers (frozen, never trained); :func:`packed_as_parameters` turns them into frozen parameters
for FSDP, which shards parameters only (``RecoverConfig.shard_base``).

Tuning (``qrecover tune``, :mod:`qrecover.recovery.tune`): :meth:`_Packed.set_masters` gives chosen continuous tensors
(``lut``, ``scale``) an fp32 master Parameter ``<name>_master``, in units of its row's magnitude; the dense weight is
then a differentiable function of the masters through the frozen codes (the scheme's own ``dequantize``), recomputed
every forward, and :meth:`_Packed.commit_masters` rounds them back into the stored dtype. The codes (``qdata``) may
train too, through a master weight whose nearest codes are re-assigned every forward (straight-through gradient).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels, packing
from .errors import QRecoverError
from .schemes import QuantizedWeight, get_quantizer


class _Packed(nn.Module):
    """Common part: the packed tensors as buffers (or frozen parameters, :func:`packed_as_parameters`) plus what
    is needed to dequantize them."""

    def __init__(self, qw: QuantizedWeight, cache: bool = False):
        nn.Module.__init__(self)  # not nn.Linear.__init__: there is no dense weight Parameter to allocate
        self.scheme, self.bits, self.shape, self.params = qw.scheme, qw.bits, tuple(qw.shape), dict(qw.params)
        self._quantizer = get_quantizer(qw.scheme, **qw.params)
        for name, t in qw.tensors.items():
            self.register_buffer(name, t)
        self._tensor_names = tuple(qw.tensors)
        self.cache = cache
        self._dense: torch.Tensor | None = None
        self._dispatch_dense: torch.Tensor | None = None  # the measured dispatch's dense copy (qrecover.kernels.dispatch)
        self.compute_dtype = torch.float32  # dtype of `weight` and of lookups; follows .half()/.to(dtype)
        self._masters: tuple[str, ...] = ()  # stored tensors that have a trainable fp32 master (set_masters)

    def _apply(self, fn, recurse=True):
        """``.to()``/``.half()``/``.cuda()``: the packed tensors move device but keep their stored dtypes (a
        cast would change what is stored, and fp16 tables through bf16 would lose bits); a dtype change sets
        :attr:`compute_dtype` instead. The dense cache is dropped. The same whether the packed tensors are
        buffers or frozen parameters (:func:`packed_as_parameters`)."""
        probe, probe16 = fn(torch.zeros((), dtype=torch.float32)), fn(torch.zeros((), dtype=torch.float16))
        held = [(store, n, store.pop(n)) for n in self._tensor_names for store in (self._buffers, self._parameters)
                if n in store]
        try:
            super()._apply(fn, recurse)
        finally:
            for store, n, t in held:
                moved = t.to(device=probe.device)
                if isinstance(t, nn.Parameter) and not isinstance(moved, nn.Parameter):
                    moved = nn.Parameter(moved, requires_grad=False)
                store[n] = moved
        if probe.dtype != torch.float32 or probe16.dtype != torch.float16:  # a cast, not only a move
            self.compute_dtype = probe.dtype
        self._dense = self._dispatch_dense = None
        return self

    @property
    def packed(self) -> QuantizedWeight:
        """The packed weight as a :class:`QuantizedWeight` (named `packed`, not `qweight`: PEFT reads a
        `qweight` attribute as a GPTQ tensor)."""
        tensors = {n: getattr(self, n) for n in self._tensor_names}
        return QuantizedWeight(self.scheme, self.bits, self.shape, self.params, tensors)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def set_masters(self, names: tuple[str, ...], code_step: float = 1.0) -> None:
        """Train the stored tensors ``names`` (e.g. ``("lut",)``): each ``t`` gets an fp32 master Parameter
        ``<name>_master = t / unit`` of its shape, ``unit (rows, 1)`` (buffer ``<name>_unit``) the power of two nearest
        each row's RMS, so ``master * unit`` is ``t`` exactly. In those units an optimizer step of a given size is the
        same relative change for a 2-bit table entry of 0.05 and an 8-bit embedding scale of 0.001 (Adam moves every
        value by about lr, whatever its magnitude). The dense cache is dropped, and :meth:`dequantize` computes the
        weight from ``master * unit`` with gradients (codes and the other tensors stay frozen).

        ``"qdata"`` (the codes, PV-tuning's discrete step) gets a master *weight* ``(out, in)`` instead, starting at
        the dequantized weight: each forward re-assigns every code to the entry nearest the master (the scheme's
        ``encode``) and passes the gradient straight through to the master. Its unit is its row's RMS times
        ``code_step`` (a larger step per update than the tables', so that a code can cross to its neighbour)."""
        for n in names:
            t = getattr(self, n)
            if n == "qdata":
                t = self.dequantize(torch.float32).detach()
            elif n not in self._tensor_names or not t.is_floating_point():
                raise QRecoverError(f"{n!r} is not a continuous tensor of this {self.scheme} layer ({self._tensor_names})")
            rows = t.detach().float().reshape(t.shape[0] if t.dim() > 0 else 1, -1)
            rms = rows.pow(2).mean(-1, keepdim=True).sqrt()
            unit = torch.where(rms > 0, torch.exp2(torch.round(torch.log2(rms.clamp_min(1e-30)))), torch.ones_like(rms))
            unit = unit * code_step if n == "qdata" else unit
            self.register_buffer(f"{n}_unit", unit, persistent=False)
            self.register_parameter(f"{n}_master", nn.Parameter((rows / unit).reshape(t.shape)))
        # the codes last: they are re-assigned under the tables/scales (commit_masters rounds those first)
        self._masters = tuple(sorted(names, key=lambda n: n == "qdata"))
        self._dense, self._dispatch_dense = None, None

    def _master_value(self, n: str) -> torch.Tensor:
        """The trained value of stored tensor ``n``: ``master * unit`` (fp32, its stored shape; for ``"qdata"`` the
        master weight ``(out, in)``)."""
        master = getattr(self, f"{n}_master")
        unit = getattr(self, f"{n}_unit")
        return (master.reshape(unit.shape[0], -1) * unit).reshape(master.shape)

    def _trained(self) -> QuantizedWeight:
        """The packed weight with every continuous master's value in place of its stored tensor (codes as stored)."""
        tensors = {n: self._master_value(n) if n in self._masters and n != "qdata" else getattr(self, n)
                   for n in self._tensor_names}
        return QuantizedWeight(self.scheme, self.bits, self.shape, self.params, tensors)

    def commit_masters(self) -> dict[str, torch.Tensor]:
        """Round every master to its stored tensor's dtype, store it, drop the masters; returns the new stored
        tensors by name (the codes re-assigned to the master weight under the rounded tables/scales, packed).
        Afterwards the layer is a plain packed layer again."""
        stored = {}
        for n in self._masters:
            value = self._master_value(n).detach()
            if n == "qdata":  # a code whose value is unchanged keeps its index (a table may hold an entry twice)
                packed, q = self.packed, self._quantizer
                stored_codes = packing.unpack(packed.tensors["qdata"], self.bits, packed.numel).long().view(self.shape)
                codes = q.encode(packed, value)
                codes = torch.where(q.decode(packed, codes) == q.decode(packed, stored_codes), stored_codes, codes)
                value = packing.pack(codes, self.bits)
            del self._parameters[f"{n}_master"], self._buffers[f"{n}_unit"]
            old = getattr(self, n)
            stored[n] = value.to(device=old.device, dtype=old.dtype).contiguous()
            if n in self._parameters:  # held as a frozen parameter (packed_as_parameters)
                self._parameters[n] = nn.Parameter(stored[n], requires_grad=False)
            else:
                self._buffers[n] = stored[n]
        self._masters, self._dense, self._dispatch_dense = (), None, None
        return stored

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight ``(out, in)`` in ``dtype`` (default :attr:`compute_dtype`); from the masters, with
        gradients, while :meth:`set_masters` is in effect."""
        dtype = dtype or self.compute_dtype
        if self._masters:
            qw = self._trained()
            if "qdata" not in self._masters:
                return self._quantizer.dequantize(qw, dtype)
            w = self._master_value("qdata")  # straight through: forward the decoded nearest codes, backward to w
            return self._quantizer.decode(qw, self._quantizer.encode(qw, w), dtype) + (w - w.detach()).to(dtype)
        if self._dense is not None and self._dense.dtype == dtype:
            return self._dense
        with torch.no_grad():
            dense = self._quantizer.dequantize(self.packed, dtype)
        if self.cache:
            self._dense = dense
        return dense

    def linear_weight(self, x: torch.Tensor) -> torch.Tensor:
        """The dense weight that ``F.linear(x, w)`` reads: ``dequantize(x.dtype)``, except under autocast to a lower
        precision with ``x`` in fp32 (bf16 autocast over an fp32 residual stream: the CPU's recovery), where autocast
        would cast the fp32 weight to its dtype at every call. With the cache on, that cast is made once and kept in
        place of the fp32 weight (half its bytes): the same values as autocast's cast, so the same outputs."""
        kind = x.device.type
        low = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        if x.dtype != torch.float32 or low not in (torch.float16, torch.bfloat16) or self._masters or not self.cache:
            return self.dequantize(x.dtype)
        found = self.__dict__.get("_dense_autocast")
        if found is None or found.dtype != low:
            with torch.no_grad():
                found = self.dequantize(torch.float32).to(low)
            self._dense = None  # the fp32 weight is not kept beside its cast (a later fp32 use dequantizes again)
            self.__dict__["_dense_autocast"] = found
        return found

    @property
    def _dense(self) -> torch.Tensor | None:
        """The dense cache (:meth:`dequantize`); setting it (None: dropped) drops :meth:`linear_weight`'s cast too."""
        return self.__dict__.get("_dense_main")

    @_dense.setter
    def _dense(self, value: torch.Tensor | None) -> None:
        self.__dict__["_dense_main"] = value
        self.__dict__.pop("_dense_autocast", None)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, scheme={self.scheme}, bits={self.bits}, params={self.params}"


class QuantLinear(_Packed, nn.Linear):
    """A linear layer ``y = x W^T + b`` whose ``W (out_features, in_features)`` is stored packed.

    It is an ``nn.Linear`` to the outside world (``isinstance`` holds, ``in_features``/``out_features``/
    ``weight``/``bias`` are there), so libraries that wrap linear layers by type accept it as a base
    layer: PEFT's LoRA wraps it with its own ``lora.Linear`` and calls this forward for the frozen part.
    ``weight`` is a read-only dequantized tensor, not a Parameter: nothing can train or merge into it.
    """

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, cache: bool = False):
        super().__init__(qw, cache)
        self.out_features, self.in_features = self.shape
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (read-only view for code that inspects ``.weight``)."""
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.gpu_device(x.device) and not self._masters:  # fused dequant-matmul kernel, a dense copy, or the reference path (kernels.select)
            return kernels.linear(self, x)
        return kernels.reference.linear(self, x)

    def set_packed(self, qw: QuantizedWeight) -> None:
        """Replace the packed weight by ``qw`` (same shape ``(out_features, in_features)``; scheme and bits may
        differ): its tensors become the buffers, on this layer's device, and the dense cache is dropped.
        Used by the PEFT merge (:mod:`qrecover.adapters.peft_quant`)."""
        if tuple(qw.shape) != self.shape:
            raise QRecoverError(f"packed weight of shape {tuple(qw.shape)} cannot replace this layer's {self.shape}; "
                                "quantize a weight of the layer's own shape")
        device = getattr(self, self._tensor_names[0]).device
        for name in self._tensor_names:
            delattr(self, name)
        self.__dict__.get("_stored_dtypes", {}).clear()  # the new tensors are held as they are
        self.scheme, self.bits, self.params = qw.scheme, qw.bits, dict(qw.params)
        self._quantizer = get_quantizer(qw.scheme, **qw.params)
        for name, t in qw.tensors.items():
            self.register_buffer(name, t.to(device))
        self._tensor_names = tuple(qw.tensors)
        self._dense = self._dispatch_dense = None


class QuantEmbedding(_Packed):
    """An embedding table ``(num_embeddings, embedding_dim)`` stored packed.

    Built on its own, its forward is a plain lookup. Built with :meth:`replacing` an architecture's own
    embedding module (Gemma's ``*ScaledWordEmbedding`` multiplies the lookup by ``sqrt(hidden_size)``),
    it keeps that module's class, forward, buffers and attributes: only where ``weight`` comes from changes.
    """

    def __init__(self, qw: QuantizedWeight, padding_idx: int | None = None, cache: bool = True):
        super().__init__(qw, cache)
        self.num_embeddings, self.embedding_dim = self.shape
        self.padding_idx = padding_idx

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` in :attr:`compute_dtype`. On the CPU and while training, only those rows are decoded
        (:meth:`lookup`) unless a dense cache in that dtype exists already (a tied head on the CPU makes one): no dense
        copy of the table is made for lookups (a 1B model's 128k x 2048 table is 1 GB in fp32; an untied 8B's, 2 GB).
        In inference on a GPU the dense cache is kept as before: one gather per decoded token rather than the ~20 small
        launches of a row decode."""
        cached = self._dense is not None and self._dense.dtype == self.compute_dtype
        if self._masters or cached or (ids.device.type != "cpu" and not self.training):
            return F.embedding(ids, self.dequantize(), self.padding_idx)
        return self.lookup(ids)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``dequantize()[ids]``, decoding only the rows of ``ids`` where the scheme can (:meth:`Quantizer.rows`;
        every row asked for, repeats included: no ``unique``, whose size the host would have to read)."""
        flat = ids.reshape(-1).long()
        rows = self._quantizer.rows(self.packed, flat, self.compute_dtype)
        if rows is None:  # no row access for this scheme or width: the whole table (and the cache, if kept)
            return F.embedding(ids, self.dequantize(), self.padding_idx)
        return rows.reshape(*ids.shape, self.embedding_dim)

    @classmethod
    def replacing(cls, old: nn.Embedding, qw: QuantizedWeight, cache: bool = True) -> "QuantEmbedding":
        """A packed embedding that behaves as ``old`` does (``old.weight`` shape ``(vocab, hidden)``).

        A plain ``nn.Embedding`` (no max_norm, no sparse gradients) gives a :class:`QuantEmbedding`. Any other
        class gives an instance of a subclass of both, ``Quant<Class>``, whose forward is ``old``'s: its
        buffers (e.g. ``embed_scale``) and plain attributes are carried over, its ``weight`` Parameter is
        replaced by the dequantized packed tensor.
        """
        if not isinstance(old, nn.Embedding):
            raise QRecoverError(f"cannot replace {type(old).__name__} with a packed embedding: it is not an nn.Embedding")
        if tuple(old.weight.shape) != tuple(qw.shape):
            raise QRecoverError(f"{type(old).__name__} has shape {tuple(old.weight.shape)}, the packed weight {tuple(qw.shape)}: "
                                "the checkpoint does not match its config; compress again")
        plain = type(old) is nn.Embedding and old.max_norm is None and not old.sparse
        klass = cls if plain else _packed_embedding_class(type(old))
        new = klass.__new__(klass)
        QuantEmbedding.__init__(new, qw, padding_idx=old.padding_idx, cache=cache)
        if not plain:
            skip = set(vars(new)) | {"weight"}
            for k, v in vars(old).items():  # max_norm, norm_type, scalar_embed_scale, ...
                if k not in skip and not k.startswith("_"):
                    setattr(new, k, v)
            for k, b in old._buffers.items():  # e.g. embed_scale
                new.register_buffer(k, b, persistent=k not in old._non_persistent_buffers_set)
            for k, m in old._modules.items():
                new.add_module(k, m)
        return new

    def __reduce_ex__(self, protocol):
        base = getattr(type(self), "_replaced_class", None)
        if base is None:
            return super().__reduce_ex__(protocol)
        # a run-time class cannot be pickled by name: rebuild it from the class it replaced (importable)
        return _new_packed_embedding, (base,), self.__getstate__()


@functools.cache
def _packed_embedding_class(base: type) -> type:
    """``Quant<base>``: a :class:`QuantEmbedding` that is also a ``base`` and runs ``base.forward``."""
    return type(f"Quant{base.__name__}", (QuantEmbedding, base),
                {"forward": base.forward, "_replaced_class": base, "__module__": __name__,
                 "__qualname__": f"Quant{base.__name__}"})


def _new_packed_embedding(base: type) -> QuantEmbedding:
    """An empty ``Quant<base>`` for unpickling (its state is set by ``__setstate__``)."""
    klass = _packed_embedding_class(base)
    return klass.__new__(klass)


#: a floating dtype of each element width: an integer tensor held as one holds the same bytes
_FLOAT_OF_WIDTH = {1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32, 8: torch.float64}


class _ReadsStoredDtypes:
    """Mixed into a packed module whose integer tensors are held as float parameters of the same width
    (:func:`packed_as_parameters`): reading one by name gives it back in its stored dtype, the same bytes. A shard
    of one (a DTensor, between FSDP's gathers) is returned as held: only its bytes are read then."""

    def __getattr__(self, name: str):
        t = super().__getattr__(name)
        dtype = self.__dict__["_stored_dtypes"].get(name)
        return t if dtype is None or hasattr(t, "to_local") else t.view(dtype)


_READS_STORED: dict[type, type] = {}


def _reads_stored(cls: type) -> type:
    """``cls`` with :class:`_ReadsStoredDtypes` mixed in (one subclass per class, of the same name)."""
    if cls not in _READS_STORED:
        _READS_STORED[cls] = type(cls.__name__, (_ReadsStoredDtypes, cls), {"__module__": cls.__module__})
    return _READS_STORED[cls]


def packed_as_parameters(model: nn.Module) -> None:
    """Hold the packed tensors of every packed module in ``model`` as frozen parameters (``requires_grad=False``)
    instead of buffers, and turn their dense cache off: what FSDP needs to shard the base (it shards parameters and
    keeps buffers whole on every process), and a cached dense weight would be a whole copy per process.

    Integer tensors are held as a float dtype of their width, bit for bit, and read back in their own dtype (the
    module's class gains :class:`_ReadsStoredDtypes`): FSDP2 before torch 2.12 makes each sharded parameter with
    ``requires_grad=True`` first, which no integer tensor can have (pytorch/pytorch#177844). One path on every
    torch version.

    State-dict names, :attr:`_Packed.packed` and ``.to(dtype)`` (which casts none of them) are unchanged. 0-dim
    tensors stay buffers: FSDP shards along dim 0.
    """
    for m in model.modules():
        if isinstance(m, _Packed):
            m.cache, m._dense = False, None
            stored = m.__dict__.setdefault("_stored_dtypes", {})
            for n in m._tensor_names:
                t = m._buffers.get(n)
                if t is not None and t.dim() > 0:
                    del m._buffers[n]
                    if not t.is_floating_point():
                        stored[n], t = t.dtype, t.view(_FLOAT_OF_WIDTH[t.element_size()])
                    m.register_parameter(n, nn.Parameter(t, requires_grad=False))
            if stored and not isinstance(m, _ReadsStoredDtypes):
                m.__class__ = _reads_stored(type(m))


def local_packed_bytes(model: nn.Module) -> int:
    """Bytes of packed weights this process holds: the whole base, or this process's shards when FSDP shards it
    (a sharded tensor counts its local part)."""
    total = 0
    for m in model.modules():
        if isinstance(m, _Packed):
            for n in m._tensor_names:
                t = getattr(m, n)
                t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this process's shard
                total += t.numel() * t.element_size()
    return total


class QuantLMHead(nn.Module):
    """The output projection tied to a :class:`QuantEmbedding`: the packed matrix is stored once.

    On CUDA it is a packed linear layer to the kernels (:func:`qrecover.kernels.linear`): the measured dispatch picks
    the fused kernel, torch's int4 matmul or a dense matmul, whichever it timed faster. The embedding's dense cache is
    for its lookups, which read a few rows per token; the head reads the whole matrix at every token (on a 1B model
    with a 128k vocabulary, 525 MB in fp16 against about 152 MB packed at 4 bits), so that cache does not decide the head's path.
    Its dense candidate is the embedding's cache where the dtypes agree (no second copy). On the CPU, while training,
    and while the embedding trains (``qrecover tune``) it is ``F.linear`` on the embedding's dense weight, as before.
    """

    #: what the kernels read from a packed layer, taken from the embedding (the packed tensors by their own names)
    _SHARED = frozenset({"scheme", "bits", "shape", "params", "_quantizer", "_tensor_names", "_masters", "compute_dtype",
                         "nbytes", "packed"})
    bias = None
    cache = False  # the embedding's cache serves lookups; the dispatch chooses the head's path

    def __init__(self, embedding: QuantEmbedding):
        super().__init__()
        object.__setattr__(self, "embedding", embedding)  # a reference, not a submodule: no duplicate state
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings
        self._dense = self._dispatch_dense = None

    def __getattr__(self, name: str):
        emb = self.__dict__.get("embedding")
        if emb is not None and (name in QuantLMHead._SHARED or name in emb._tensor_names):
            return getattr(emb, name)
        return super().__getattr__(name)

    def _apply(self, fn, recurse=True):
        """A move or cast drops what the kernels kept for the old device or dtype (the embedding moves itself)."""
        for name in ("_dispatch_dense", "_dispatch_int4", "_kernel_repack", "_nibble_repack"):
            self.__dict__.pop(name, None)
        self._dense = self._dispatch_dense = None
        return super()._apply(fn, recurse)

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.dequantize()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The embedding's dense weight (its cache where it keeps one in ``dtype``)."""
        return self.embedding.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.gpu_device(x.device) and not self.embedding._masters:
            return kernels.linear(self, x)
        return F.linear(x, self.embedding.dequantize(x.dtype))
