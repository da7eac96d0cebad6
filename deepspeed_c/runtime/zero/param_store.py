"""Where ZeRO-3 parameters live between uses: the sharded 16-bit (model dtype) storage and the
gather/release of *units*.

Parameters are held in groups (one per optimizer param group, plus one for parameters no optimizer
steps). Each group has a PartitionPlan whose buckets are runs of one module's parameters; a bucket is
the unit the runtime all-gathers: it is split into W equal chunks and rank r keeps chunk r, so the
rank's whole storage of the group is one flat tensor (`shard`), laid out exactly like the fp32 master
partition of the ZeRO optimizer (the plan's runtime layout) and like the gradient partition the
reduce-scatter fills. Gathering a unit is one all_gather_into_tensor of its chunk into a buffer of the
bucket's size; the parameters become views into that buffer (no copy out). Releasing a unit points the
parameters back at empty placeholders and drops the buffer.

A parameter's placeholder keeps DeepSpeed's contract (numel() == 0, ds_* attributes, see
partition_parameters.py). Units are numbered globally: unit ids run over the groups' buckets in order."""
from __future__ import annotations

from enum import Enum
from typing import Any, Optional, Sequence

import torch

from deepspeed_c.accelerator.host_memory import host_zeros
from deepspeed_c.ops.partition import PartitionPlan
from deepspeed_c.runtime.zero.unit_gather import UnitGatherer

UNIT_ATTR = "_dsc_z3"  # on each parameter: (store, unit id, offset in the unit's bucket)


class ZeroParamStatus(Enum):
    """DeepSpeed's ds_status values (public as deepspeed_c.runtime.zero.partition_parameters.ZeroParamStatus)."""
    AVAILABLE = 1  # gathered: the whole value is present on this rank
    NOT_AVAILABLE = 2  # partitioned: only ds_tensor holds this rank's shard
    INFLIGHT = 3  # being gathered


def module_runs(params: Sequence[torch.nn.Parameter], owner: dict[int, int]) -> list[int]:
    """A bucket id per parameter: consecutive parameters of the same owning module share a bucket."""
    out: list[int] = []
    last: Optional[int] = None
    for p in params:
        m = owner.get(id(p), -1)
        if not out:
            out.append(0)
        else:
            out.append(out[-1] if m == last else out[-1] + 1)
        last = m
    return out


class ParamStore:
    """The sharded storage of every ZeRO-3 parameter of one model, and its gathered units."""

    file_backed = False  # shards are not where gathers read from (NVMe swap): a gathered unit never aliases one

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]], owner: dict[int, int], *, rank: int,
                 world_size: int, group: Any, dtype: torch.dtype, compute_device: torch.device,
                 home_device: Optional[torch.device] = None, pin_memory: bool = False,
                 persistence_threshold: int = 0, model_persistence_threshold: Optional[int] = None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.dtype = dtype
        self.compute_device = compute_device
        self.home_device = home_device or compute_device
        self.groups: list[list[torch.nn.Parameter]] = [list(g) for g in groups]
        self.plans: list[PartitionPlan] = []
        self.shards: list[torch.Tensor] = []
        self.unit_of: list[tuple[int, int]] = []  # unit -> (group, bucket)
        self.unit_params: list[list[tuple[torch.nn.Parameter, int]]] = []  # unit -> [(param, offset in bucket)]
        self.unit_numel: list[int] = []
        self.first_unit: list[int] = []
        pin = pin_memory and self.home_device.type == "cpu" and torch.cuda.is_available()
        for g, params in enumerate(self.groups):
            numels = [full_numel(p) for p in params]
            plan = PartitionPlan.build(numels, world_size, 1, 1, None, module_runs(params, owner)) if params else None
            self.plans.append(plan)  # type: ignore[arg-type]
            size = plan.runtime_partition_size if plan is not None else 0
            self.shards.append(host_zeros(size, dtype, pin) if torch.device(self.home_device).type == "cpu" else
                               torch.zeros(size, dtype=dtype, device=self.home_device))
            self.first_unit.append(len(self.unit_of))
            if plan is None:
                continue
            for b in range(plan.num_buckets):
                self.unit_of.append((g, b))
                self.unit_params.append([])
                self.unit_numel.append(plan.bucket_size[b])
            for i, p in enumerate(params):
                b = plan.param_bucket[i]
                u = self.first_unit[g] + b
                self.unit_params[u].append((p, plan.param_offset[i] - plan.bucket_offset[b]))
        n_units = len(self.unit_of)
        self.full: list[Optional[torch.Tensor]] = [None] * n_units
        self.works: list[Any] = [None] * n_units
        self.ready = [False] * n_units  # gathered and its parameters point at the gathered values
        self._views: list[Optional[list]] = [None] * n_units  # per unit, its parameters' views (_view_specs)
        self.on_write_back: Optional[Any] = None  # (group, start, end) -> None: the optimizer's masters follow
        self.on_before_read: Optional[Any] = None  # (units) -> None: a deferred step writes their chunks first
        self.pins = [0] * n_units  # users of a live unit (running modules, GatheredParameters): not released
        # DeepSpeed's persistence: small units stay gathered between uses (until the weights change),
        # as long as the persistent total stays under the model threshold
        budget = model_persistence_threshold if model_persistence_threshold is not None else 1 << 62
        self.persistent = [False] * n_units
        if world_size == 1 and self.home_device == compute_device and not self.file_backed:
            # one rank holding its shards on the compute device: a gathered unit is a view of its shard,
            # so keeping every unit gathered costs nothing
            persistence_threshold, budget = 1 << 62, 1 << 62
        for u in sorted(range(n_units), key=lambda u: self.unit_numel[u]):
            real = sum(full_numel(p) for p, _ in self.unit_params[u])
            if real < persistence_threshold and real <= budget:
                self.persistent[u] = True
                budget -= real
        self.live_numel = 0
        self.peak_live_numel = 0
        # units the optimizer step gathered ahead of the next forward (stage3.ShardWriter): the forward's first
        # step takes them over; any other gather first drops them (they were never asked for by a user)
        self.early: set[int] = set()
        self.gathers = 0
        # ZeRO++ (zeropp.py), attached by the stage-3 optimizer (use_zeropp): quantized gathers, hpZ secondary shards
        self.zeropp: Optional[Any] = None
        self.secondary: list[Optional[torch.Tensor]] = [None] * n_units  # hpZ: this rank's 1/H of the unit
        self.frozen: set[int] = set()  # units gathered as int8 under zero_quantized_nontrainable_weights
        self.frozen_codes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # their codes, cut once
        self.gatherer = UnitGatherer(group) if world_size > 1 else None  # type: ignore[assignment]

    # -- layout --------------------------------------------------------------------------------------
    def chunk_range(self, u: int) -> tuple[int, int]:
        g, b = self.unit_of[u]
        plan = self.plans[g]
        start = plan.bucket_offset[b] // self.world_size
        return start, start + plan.bucket_size[b] // self.world_size

    def local_pieces(self, g: int, i: int) -> list[tuple[int, int, int]]:
        """(param_start, local_start, length) of param i of group g inside this rank's shard."""
        return [(ps, ls, n) for param, _, ps, ls, n, _ in self.plans[g].slices("runtime", self.rank) if param == i]

    @torch.no_grad()
    def load_full(self, g: int, i: int, value: torch.Tensor) -> None:
        """This rank's pieces of param i of group g cut from its whole value."""
        flat = value.detach().reshape(-1)
        for ps, ls, n in self.local_pieces(g, i):
            self.shards[g][ls:ls + n].copy_(flat[ps:ps + n])
        if self.plans[g] is not None:
            self.drop_secondary([self.first_unit[g] + self.plans[g].param_bucket[i]])

    # -- gather / release ----------------------------------------------------------------------------
    def is_live(self, u: int) -> bool:
        return self.full[u] is not None

    @property
    def aliased(self) -> bool:
        """Gathered units are views of the shards (one rank, shards on the compute device)."""
        return self.world_size == 1 and self.home_device == self.compute_device and not self.file_backed

    def source_chunk(self, u: int, start: int, end: int) -> torch.Tensor:
        """This rank's chunk of unit u, the input of its gather (the NVMe store reads it into a swap buffer)."""
        return self.shards[self.unit_of[u][0]][start:end]

    def wrote(self, g: int, start: int, end: int) -> None:
        """Elements [start, end) of group g's shard were just rewritten (the NVMe store drops their pages)."""

    def fetch(self, units: Sequence[int], private: bool = False, lossy: bool = False) -> None:
        """Starts gathering the units not already live or in flight (asynchronous where the backend is);
        `private`: copies even where a view of the shard would do (edits must not reach the shard);
        `lossy`: gather-on-use may take ZeRO++'s quantized or secondary (hpZ) gathers. The plain gathers of
        one call go out as one coalesced collective (one NCCL launch for a fetch-plan group). Nothing here
        records autograd history (shards never require grad), so no no_grad context: this runs per module."""
        if self.on_before_read is not None:
            self.on_before_read(units)
        plain: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (unit, gathered buffer, this rank's chunk)
        for u in units:
            if self.full[u] is not None:
                continue
            start, end = self.chunk_range(u)
            chunk = self.source_chunk(u, start, end)
            if chunk.device != self.compute_device:
                chunk = chunk.to(self.compute_device, non_blocking=True)
            if self.world_size == 1:  # the shard is the whole unit: its parameters view it (or its device copy)
                full = chunk.clone() if private and chunk.data_ptr() == self.shards[self.unit_of[u][0]].data_ptr() \
                    + start * chunk.element_size() else chunk
                self.works[u] = None
            else:
                full = torch.empty((end - start) * self.world_size, dtype=self.dtype, device=self.compute_device)
                if self.zeropp is not None and lossy and not self.persistent[u]:
                    self.works[u] = self._zeropp_gather(u, chunk, full)
                else:
                    plain.append((u, full, chunk))
                    if self.file_backed:  # its chunk sits in a swap buffer the next unit's read may take back
                        self._issue(plain)
                        plain = []
            self.full[u] = full
            self.gathers += 1
            if not self.persistent[u]:  # stage3_max_live_parameters counts the units that come and go
                self.live_numel += full.numel()
                self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
            inflight = ZeroParamStatus.INFLIGHT
            for p, _ in self.unit_params[u]:
                p.ds_status = inflight
        if plain:
            self._issue(plain)

    def mark_early(self, units: Sequence[int]) -> None:
        """The optimizer step gathered these ahead of the next forward (the forward's first step takes them over)."""
        self.early = set(units)

    def take_early(self) -> None:
        """The forward's first gather took the units gathered ahead over: they are the plan's from here on."""
        self.early = set()

    def drop_early(self, keep: Sequence[int] = ()) -> None:
        """Releases the units gathered ahead of the next forward, except `keep`, so a gather from elsewhere
        (GatheredParameters between the step and the forward) stays within the live limit."""
        units = [u for u in self.early if u not in keep]
        self.early = set()
        self.release(units)

    def _issue(self, plain: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        work = self.gatherer.gather([f for _, f, _ in plain], [c for _, _, c in plain])
        for u, _, _ in plain:
            self.works[u] = work

    def wait(self, units: Sequence[int], private: bool = False, lossy: bool = False) -> None:
        """The units' parameters point at their gathered values (fetching any not started)."""
        if self.on_before_read is not None:  # also for units live already (views of the shards on one rank)
            self.on_before_read(units)
        self.fetch(units, private, lossy)
        for u in units:
            work = self.works[u]
            if work is not None:
                work.wait()
                self.works[u] = None
            if self.ready[u]:
                continue
            full = self.full[u]
            assert full is not None
            base = full.storage_offset()  # as_strided's offset counts from the storage (a shard view has one)
            views = self._views[u]
            if views is None:
                views = self._views[u] = self._view_specs(u)
            available = ZeroParamStatus.AVAILABLE
            for p, shape, strides, off in views:
                p.data = full.as_strided(shape, strides, base + off)
                p.ds_status = available
            self.ready[u] = True

    def _view_specs(self, u: int) -> list[tuple[torch.nn.Parameter, Any, tuple[int, ...], int]]:
        """(param, shape, strides, offset in the unit) of each parameter of unit u: fixed for the store's life,
        and read at every gather of the unit (twice an iteration: forward and backward)."""
        return [(p, p.ds_shape, _contiguous_strides(p.ds_shape), off) for p, off in self.unit_params[u]]

    def _zeropp_gather(self, u: int, chunk: torch.Tensor, full: torch.Tensor) -> Any:
        """ZeRO++'s gather of unit u: from its hpZ secondary shard inside the group of H when it has one,
        as int8 codes under qwZ (or for a frozen unit under zero_quantized_nontrainable_weights)."""
        zpp = self.zeropp
        frozen = zpp.quantized_nontrainable_weights and u in self.frozen
        quantized = zpp.quantized_weights or frozen
        secondary = self.secondary[u]
        if secondary is not None:
            return zpp.gather(secondary, full, quantized=quantized, secondary=True)
        if frozen:
            codes = self.frozen_codes.get(u)
            if codes is None:
                from deepspeed_c.ops.quantizer import quantize

                codes = self.frozen_codes[u] = quantize(chunk.contiguous(), 8, zpp.weight_block)
            return zpp.gather(chunk, full, quantized=True, secondary=False, codes=codes)
        return zpp.gather(chunk, full, quantized=quantized, secondary=False)

    def drop_secondary(self, units: Optional[Sequence[int]] = None) -> None:
        """The weights changed: hpZ secondary shards (and cached codes of frozen units) are stale."""
        for u in (range(len(self.secondary)) if units is None else units):
            self.secondary[u] = None
            self.frozen_codes.pop(u, None)

    def release(self, units: Sequence[int], keep_secondary: bool = True) -> None:
        """Drops the units' gathered values (a unit still pinned by a user stays). Under hpZ a released unit
        whose gathered values are current leaves this rank its secondary shard (unless `keep_secondary` is
        false: the weights are about to change or just did)."""
        for u in units:
            full = self.full[u]
            if full is None or self.pins[u] > 0:
                continue
            if self.works[u] is not None:  # never leave a collective behind: it writes into `full`
                self.works[u].wait()
                self.works[u] = None
            zpp = self.zeropp
            if keep_secondary and zpp is not None and zpp.hpz_size > 1 and self.ready[u] and \
                    self.secondary[u] is None and not self.persistent[u]:
                self.secondary[u] = zpp.secondary_piece(full)
            device, gone = self.compute_device, ZeroParamStatus.NOT_AVAILABLE
            for p, _ in self.unit_params[u]:
                p.data = torch.empty(0, dtype=p.dtype, device=device)  # placeholder(), inlined: once a parameter
                p.ds_status = gone
            self.full[u] = None
            self.ready[u] = False
            if not self.persistent[u]:
                self.live_numel -= full.numel()

    # -- what the stage-3 optimizer and the coordinator configure -----------------------------------
    def use_gatherer(self, gatherer: Any) -> None:
        """Plain unit gathers go through `gatherer` (gather(outputs, inputs) -> waitable) instead of one
        all-gather over the store's group: MiCS's hierarchical gather (runtime/zero/mics.py)."""
        if self.world_size > 1:
            self.gatherer = gatherer

    def use_zeropp(self, zeropp: Optional[Any]) -> None:
        """Gathers go through ZeRO++ (`zeropp`, None: plain all-gathers); its frozen units are marked."""
        self.zeropp = zeropp
        if zeropp is not None:
            self.mark_frozen_units()

    def mark_frozen_units(self) -> None:
        """The units whose parameters are all frozen (zero_quantized_nontrainable_weights gathers them as
        int8); their cached int8 codes are cut again."""
        self.frozen = {u for u, members in enumerate(self.unit_params)
                       if members and not any(p.requires_grad for p, _ in members)}
        self.frozen_codes.clear()

    def follow_write_backs(self, callback: Optional[Any]) -> None:
        """callback(group, start, end) after each write_back (the optimizer's masters follow the shard)."""
        self.on_write_back = callback

    def before_reads(self, callback: Optional[Any]) -> None:
        """callback(units) before units' shards are read (SuperOffload's deferred step commits them first)."""
        self.on_before_read = callback

    def unpin_all(self) -> None:
        """No unit has users any more (the end of an iteration): every one may be released."""
        self.pins = [0] * len(self.pins)

    def release_all(self, keep_persistent: bool = True) -> None:
        """Every unit released (after a step the gathered values are stale: persistent ones go too, and so
        do hpZ's secondary shards)."""
        if not keep_persistent:
            self.unpin_all()
            self.drop_secondary()
        self.release([u for u in range(len(self.full)) if not (keep_persistent and self.persistent[u])],
                     keep_secondary=keep_persistent)

    # -- writes back ---------------------------------------------------------------------------------
    @torch.no_grad()
    def write_back(self, u: int) -> None:
        """A live unit's (possibly modified) values written into this rank's chunk."""
        full = self.full[u]
        assert full is not None
        start, end = self.chunk_range(u)
        g = self.unit_of[u][0]
        n = end - start
        self.shards[g][start:end].copy_(full[self.rank * n:(self.rank + 1) * n])
        self.wrote(g, start, end)
        self.drop_secondary([u])
        if self.on_write_back is not None:
            self.on_write_back(g, start, end)


def full_numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def _contiguous_strides(shape: Any) -> tuple[int, ...]:
    """Row-major strides of `shape` (cached: a unit's views are rebuilt at every gather)."""
    key = tuple(shape)
    strides = _STRIDES.get(key)
    if strides is None:
        acc, out = 1, []
        for n in reversed(key):
            out.append(acc)
            acc *= max(int(n), 1)
        strides = _STRIDES[key] = tuple(reversed(out))
    return strides


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor (DeepSpeed's partitioned parameter data: numel() == 0)."""
    return torch.empty(0, dtype=dtype, device=device)
