"""Loading a checkpoint, under any parallel layout (the format: checkpoint_format.py).

Loading checks the checkpoint before reading it, on every rank, and the ranks agree on the outcome
(one all-gather) so a problem only some ranks can see fails all of them with the same one-line
`UserError` instead of leaving the others blocked in a collective: a missing or truncated `.metadata`
or data file, a parameter missing from the checkpoint or saved with another shape, parameters the
model lacks (the two key mismatches as --dist-ckpt-strictness says: by default both stop the load), a different
optimizer. DCP reshards the global tensors to this rank's pieces; the
vocabulary rows, padded per layout, are re-padded here.

`read_full_checkpoint` reads whole tensors in one process, without torch.distributed
(tools/checkpoint_convert.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_po import parallel_state as ps
from megatron_po.distributed.agreement import agree
from megatron_po.distributed.checkpoint_dcp import (FlatRange, dcp_load, global_shape, global_view,
                                                    is_tp_shard, read_metadata)
from megatron_po.distributed.checkpoint_format import (MTP_OWN_EMBEDDING, WORD_EMBEDDING, checkpoint_dir,
                                                       copies_beside_their_embedding, find_checkpoint, for_checkpoint,
                                                       named_buffers_global, named_parameters_for_load)
from megatron_po.distributed.checkpoint_integrity import has_manifest, verify_share
from megatron_po.distributed.checkpoint_rng import set_rng_state
from megatron_po.distributed.checkpoint_state import (grad_scalers, model_and_optimizer_state,
                                                      parallel_layout, policy_key, stepped_params, virtual_stage)
from megatron_po.errors import UserError

# Their rows are the (padded) vocabulary: padded to a multiple of --make-vocab-size-divisible-by x TP,
# so their row count may change with the layout. Loading re-pads them (rows beyond the tokenizer's
# vocabulary are never produced as inputs or labels; new ones start at zero).
VOCAB_PARAMS = (WORD_EMBEDDING, "output_layer.weight", MTP_OWN_EMBEDDING,
                "encoder_embedding.word_embeddings.weight")  # NMT's separate source vocabulary


def _repadded(name: str, saved: tuple, shape: tuple, vocab_size: int | None) -> bool:
    return (name in VOCAB_PARAMS and vocab_size is not None and saved[1:] == shape[1:]
            and min(saved[0], shape[0]) >= vocab_size)


# --dist-ckpt-strictness (Megatron's StrictHandling values) as this load honours them. Megatron's words: an
# "unexpected" key is one the model asks for and the checkpoint lacks, a "missing" key one the checkpoint holds and
# the model does not ask for. Skipped parameters keep their initial values (and get a fresh optimizer state).
RAISE_UNEXPECTED = ("raise_all", "raise_unexpected", "assume_ok_unexpected")
LOG_UNEXPECTED = ("log_unexpected", "log_all")
RAISE_MISSING = ("raise_all",)
LOG_MISSING = ("log_all",)


def _in_checkpoint(meta, name: str) -> bool:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return isinstance(meta.get(f"model.{name}"), TensorStorageMetadata)


def _check_fits(md, names, stepped: dict, load_optim: bool, vocab_size: int | None) -> str | None:
    """This rank's first reason why the checkpoint cannot be loaded into its parameters, or None."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = md.state_dict_metadata
    for name, p in names:
        saved = meta.get(f"model.{name}")
        if not isinstance(saved, TensorStorageMetadata):
            return f"parameter {name} is not in the checkpoint (saved from another model configuration?)"
        shape = global_shape(p)
        if tuple(saved.size) != shape and not _repadded(name, tuple(saved.size), shape, vocab_size):
            return f"parameter {name} has shape {tuple(saved.size)} in the checkpoint but {shape} in this model"
    if load_optim:
        missing = next((n for n, p in names if id(p) in stepped and f"optimizer_state_keys.{n}" not in meta), None)
        if missing is not None:
            return f"no optimizer state for parameter {missing}; use --no-load-optim to load the weights only"
    return None


def _mtp_copy_left_out(surplus: list[str], meta, ours: set[str]) -> bool:
    """Whether the checkpoint's asynchronous MTP copy of the embedding is left out: it is surplus, this model has
    MTP depths (whose block reads the embedding or its tied copy here), and the copy is shaped as the embedding."""
    copy, embedding = (meta.get(f"model.{n}") for n in (MTP_OWN_EMBEDDING, WORD_EMBEDDING))
    return (MTP_OWN_EMBEDDING in surplus and any(n.startswith("mtp.layers.") for n in ours)
            and embedding is not None and tuple(copy.size) == tuple(embedding.size))


def load_checkpoint(root: str, chunks, optimizer, load_optim: bool = True, load_rng: bool = True,
                    step: int | None = None, policy=None, verify: bool = True, strictness: str = "raise_all") -> dict:
    """Load checkpoint `step` (default: the tracker's) under `root` into the model (and optimizer, and
    the async weight `policy`); return its `extra`. Collective over all ranks. `verify` (not
    --no-verify-checkpoint): check every file against the checkpoint's checksums.json first, each rank
    a share of them. `strictness` (--dist-ckpt-strictness): what a parameter the checkpoint lacks, or a
    checkpoint tensor the model lacks, does (see RAISE_UNEXPECTED and its neighbours)."""
    iteration = find_checkpoint(root, step) if os.path.isdir(root) else None
    if iteration is None:
        raise UserError(f"--load {root}: no checkpoint there" if os.path.isdir(root)
                        else f"--load {root}: no such directory")
    path = checkpoint_dir(root, iteration)
    where = f"--load {path}"

    md, error = None, None
    try:
        md = read_metadata(path)  # its messages name the bad file
        if "extra" not in md.state_dict_metadata:
            error = f"{where}: not a megatron_po checkpoint (no 'extra' entry)"
        elif verify:
            error = verify_share(path, dist.get_rank(), dist.get_world_size())
    except UserError as e:
        error = str(e)
    error, _ = agree(error)
    if error:
        raise UserError(error)
    if verify and dist.get_rank() == 0 and not has_manifest(path):
        print(f"> {path} has no checksums.json (saved before checksums were written): loaded unverified",
              flush=True)
    meta = md.state_dict_metadata
    names = for_checkpoint(named_parameters_for_load(chunks), meta)
    buffers = named_buffers_global(chunks)  # loaded like weights that no optimizer steps (an expert bias)
    model_names = [n for n, _ in names + buffers]
    if strictness not in RAISE_UNEXPECTED:  # those the checkpoint lacks keep their initial values
        names = [(n, p) for n, p in names if _in_checkpoint(meta, n)]
        buffers = [(n, b) for n, b in buffers if _in_checkpoint(meta, n)]
    stepped = stepped_params(optimizer)
    load_optim = load_optim and bool(stepped)

    # Small data entries first: extra, which optimizer state to allocate, RNG, policy step count (JSON,
    # or a previous format's pickles read by checkpoint_trust's allow-list: dcp_load returns them read).
    rng_key = f"rng.rank{dist.get_rank()}"
    small = {"extra": b"", "layout": b"", "optimizer_type": b"", "policy_steps": b"", rng_key: b""}
    small.update({f"optimizer_state_keys.{n}": b"" for n, _ in names} if load_optim else {})
    small.update({k: b"" for k in meta if k.startswith("grad_scaler")} if load_optim else {})
    small.update({k: b"" for k in meta if k.startswith("policy_lr_steps.")} if policy is not None else {})
    small = {k: v for k, v in small.items() if k in meta}
    dcp_load(small, path, md)
    extra = small["extra"]

    # Does it fit? Every rank checks its own parameters, rank 0 the checkpoint's surplus; all agree.
    misfit = _check_fits(md, names + buffers, stepped, load_optim, extra.get("vocab_size"))
    error, all_names = agree(f"{where}: {misfit}" if misfit else None, model_names)
    if error is None and dist.get_rank() == 0:
        ours = {n for rank_names in all_names for n in rank_names}
        absent = sorted(n for n in ours if not _in_checkpoint(meta, n))
        if absent and strictness in LOG_UNEXPECTED:
            print(f"> {where}: {len(absent)} parameters of this model are not in the checkpoint and keep their "
                  f"initial values (--dist-ckpt-strictness {strictness}): {', '.join(absent)}", flush=True)
        extra_params = sorted(k[len("model."):] for k in meta if k.startswith("model.") and k[len("model."):] not in ours)
        if _mtp_copy_left_out(extra_params, meta, ours):
            print(f"> {path}: {MTP_OWN_EMBEDDING} (an asynchronous run's copy of the word embedding, trained apart by "
                  "the MTP loss) not loaded: this run's MTP block reads the embedding (docs/mtp.md)", flush=True)
            extra_params.remove(MTP_OWN_EMBEDDING)
        if extra_params and strictness in RAISE_MISSING:
            error = (f"{where}: the checkpoint has parameter {extra_params[0]} that this model lacks "
                     f"({len(extra_params)} such; saved from another model configuration?)")
        elif extra_params and strictness in LOG_MISSING:
            print(f"> {where}: {len(extra_params)} tensors of the checkpoint are not in this model, not loaded "
                  f"(--dist-ckpt-strictness {strictness}): {', '.join(extra_params)}", flush=True)
    error, _ = agree(error)
    if error:
        raise UserError(error)

    if load_optim:
        ours = type(next(iter(stepped.values())).inner).__name__
        theirs = small["optimizer_type"] if "optimizer_type" in small else ours
        if theirs != ours:  # every rank reads the same entry: no agreement needed
            raise UserError(f"{where}: the checkpoint holds {theirs} optimizer state but this run uses {ours}; "
                            "use --no-load-optim to load the weights only")
        # The state DCP loads into in place: the optimizer's own (created as its first step would).
        for name, p in names:
            if id(p) not in stepped:
                continue
            s = stepped[id(p)]
            saved = small[f"optimizer_state_keys.{name}"]
            s.group["lr"] = saved["lr"]
            if s.tensor is not None:  # None: distributed optimizer, other data-parallel ranks own all of it
                s.prepare_load(saved["keys"])
        _load_grad_scalers(optimizer, small, small["layout"])
    state, _ = model_and_optimizer_state(names + buffers, stepped, load_optim)
    load_policy = policy is not None and "policy_steps" in small
    policy_weights = {}
    if load_policy:  # into the weight versions the policy holds (or creates now, as its steps would)
        saved_versions = {policy_key(p): [k[len(f"policy.{name}."):] for k in meta if k.startswith(f"policy.{name}.")]
                          for name, p in names}
        policy_weights = policy.load_targets(saved_versions)
        for name, p in names:
            for key, buf in policy_weights.get(policy_key(p), {}).items():
                state[f"policy.{name}.{key}"] = global_view(p, buf)
    repad = _repad_buffers(state, names, meta)
    dcp_load(state, path, md)
    for k, v in state.items():  # non-tensor values are returned, not filled in place
        if k.startswith("optimizer.") and not (torch.is_tensor(v) or isinstance(v, FlatRange)):
            name, key = k[len("optimizer."):].rsplit(".", 1)
            stepped[id(dict(names)[name])].state[key] = v
    for target, full, rows in repad:  # this rank's rows of the re-padded vocabulary
        local = torch.zeros(target.param.shape, dtype=full.dtype, device=full.device) if isinstance(
            target, FlatRange) else target
        n = max(0, min(local.shape[0], full.shape[0] - rows))
        local.zero_()
        local[:n].copy_(full[rows:rows + n])
        if isinstance(target, FlatRange):
            target.copy_from_local(local)
    for copy, embedding in copies_beside_their_embedding(chunks):  # one entry for both (ZB-V's rank 0 with MTP)
        _copy_stepped(stepped, copy, embedding, load_optim)
    for inner in {id(x.inner): x.inner for x in stepped.values()}.values():
        inner.forget_kept_direction()  # ΔW kept from the last step describes the state before loading
    for wrapper in {id(x.wrapper): x.wrapper for x in stepped.values() if x.wrapper is not None}.values():
        wrapper.restore_model_params()  # the weights were loaded into its fp32 main params
    if repad and dist.get_rank() == 0:
        print(f"> {path}: vocabulary re-padded from {repad[0][1].shape[0]} rows to this run's padding", flush=True)
    if load_policy:
        policy.load_state_dict({"steps": small["policy_steps"], "weights": policy_weights,
                                "lr_steps": _policy_lr_steps(policy, small, small["layout"])})
    if load_rng:
        if rng_key in small and small["layout"] == parallel_layout():
            if not set_rng_state(small[rng_key]) and dist.get_rank() == 0:
                print(f"> {path} was saved on another kind of device: the tensor-parallel random streams "
                      "freshly seeded", flush=True)
        elif dist.get_rank() == 0:
            print(f"> {path} was saved under another parallel layout: random generators freshly seeded",
                  flush=True)
    return extra


def _copy_stepped(stepped: dict, copy: torch.Tensor, source: torch.Tensor, with_optimizer: bool) -> None:
    """`copy` made the loaded `source` again: the weights where the optimizer steps them (the parameter, its fp32
    main param, or this data-parallel rank's piece of it: tied copies share their buckets' layout), and their
    optimizer state."""
    to, of = stepped.get(id(copy)), stepped.get(id(source))
    if to is None or of is None:  # not stepped here: the model parameters themselves
        copy.data.copy_(source.data)
        return
    if to.tensor is None or of.tensor is None:  # the distributed optimizer: other data-parallel ranks own it all
        return
    to.tensor.data.copy_(of.tensor.data)
    if with_optimizer:
        to.state.clear()
        to.state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in of.state.items()})


def _repad_buffers(state: dict, names, meta) -> list:
    """Swap the vocabulary tensors whose row count differs from the checkpoint's for full-size buffers
    of the checkpoint's shape (DCP assembles them whole); returns (target, buffer, first global row)."""
    out = []
    params = dict(names)
    for key, value in list(state.items()):
        if not (torch.is_tensor(value) or isinstance(value, FlatRange)) or key not in meta:
            continue
        name = next((n for n in VOCAB_PARAMS if key == f"model.{n}" or key.startswith((f"optimizer.{n}.",
                                                                                        f"policy.{n}."))), None)
        saved = tuple(meta[key].size)
        if name is None or name not in params or saved == tuple(value.shape):
            continue
        p = params[name]
        local = value.to_local() if hasattr(value, "to_local") else value  # a tensor, or a piece of one
        full = torch.empty(saved, dtype=value.tensor.dtype if isinstance(value, FlatRange) else local.dtype,
                           device=p.device)
        state[key] = full
        out.append((local, full, ps.get_tensor_model_parallel_rank() * p.shape[0] if is_tp_shard(p) else 0))
    return out


def _policy_lr_steps(policy, small: dict, saved_layout: tuple) -> list[int] | None:
    """Each chunk's lr clock (applied updates, fewer than its steps when fp16 steps were skipped): the
    same key when the checkpoint holds the same layers (same number of virtual stages), else the smallest
    clock saved; None when it holds none (saved before they were kept: no skipped step counted)."""
    saved = {k: v for k, v in small.items() if k.startswith("policy_lr_steps.")}
    if not saved:
        return None
    keys = [f"policy_lr_steps.stage{virtual_stage(c)}" for c in range(len(policy.chunks))]
    same_stages = saved_layout[1] * saved_layout[3] == parallel_layout()[1] * parallel_layout()[3]
    if same_stages and all(k in saved for k in keys):
        return [saved[k] for k in keys]
    return [min(saved.values())] * len(keys)


def _load_grad_scalers(optimizers, small: dict, saved_layout: tuple) -> None:
    """Restore the loss scalers: the same key when it holds the same layers (same number of virtual
    stages), else the most cautious (smallest) scale saved."""
    saved = {k: v for k, v in small.items() if k.startswith("grad_scaler")}
    if not saved:
        return
    same_stages = saved_layout[1] * saved_layout[3] == parallel_layout()[1] * parallel_layout()[3]
    for key, scaler in grad_scalers(optimizers).items():
        if key in saved and (key == "grad_scaler" or same_stages):
            scaler.load_state_dict(saved[key])
        else:
            scaler.load_state_dict(min(saved.values(), key=lambda st: st["scale"]))


# --------------------------------------------------------------------------------------------------
# One process, no torch.distributed: consolidation (tools/checkpoint_convert.py)
# --------------------------------------------------------------------------------------------------


class CheckpointReader:
    """A checkpoint read in this process alone, without torch.distributed (DCP without a process group
    assembles each tensor from every rank's shards): `extra`, `iteration`, `specs` ({entry: DCP tensor
    metadata}) and `read(entries)`, which loads just those, each read straight into the tensor returned
    (checkpoint_read_into.py: no second copy of it while it is read)."""

    def __init__(self, root: str, step: int | None = None):
        if not os.path.isdir(root):
            raise UserError(f"--load {root}: no such directory")
        iteration = find_checkpoint(root, step)
        if iteration is None:
            raise UserError(f"--load {root}: no checkpoint there")
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        self.path, self.iteration = checkpoint_dir(root, iteration), iteration
        self.metadata = read_metadata(self.path)
        small = {"extra": b""}
        dcp_load(small, self.path, self.metadata)
        self.extra = small["extra"]
        self.specs = {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def read(self, entries) -> dict[str, torch.Tensor]:
        state = {k: torch.empty(tuple(self.specs[k].size), dtype=self.specs[k].properties.dtype) for k in entries}
        dcp_load(state, self.path, self.metadata, without_copy=True)
        return state


def read_full_checkpoint(root: str, step: int | None = None, prefix: str = "model.",
                         progress: bool = True) -> tuple[dict[str, torch.Tensor], dict, int]:
    """({name: full tensor} of the entries under `prefix`, extra, iteration) of a checkpoint, read in
    this process alone."""
    reader = CheckpointReader(root, step)
    specs = {k: v for k, v in reader.specs.items() if k.startswith(prefix)}
    out = {}
    # A few hundred MB per read keeps memory near the size of the result and gives progress steps.
    groups, group, size = [], [], 0
    for k, v in specs.items():
        group.append(k)
        size += v.size.numel() * v.properties.dtype.itemsize
        if size > 256 << 20:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    from tqdm import tqdm
    total = sum(v.size.numel() * v.properties.dtype.itemsize for v in specs.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"reading {os.path.basename(reader.path)}",
              disable=not progress) as bar:
        for group in groups:
            for k, t in reader.read(group).items():
                out[k[len(prefix):]] = t
                bar.update(t.numel() * t.element_size())
    return out, reader.extra, reader.iteration
