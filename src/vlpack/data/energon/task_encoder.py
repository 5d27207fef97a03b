"""The Qwen-VL task encoder: Energon's stages, each delegating to vlpack's single owner.

Stages (Energon calls them in this order, in its worker processes):

1. cooker `cook_conversation` — crude tar sample → `ConversationSample` (record + image bytes).
2. `encode_sample` (stateless) — vlpack's `Encoder`: the same `parse_record` and `encode` as the
   JSONL path, then the overlong policy. Never raises for a bad sample: it returns a marker
   (`encoded=None`, `status=<reason>`), so that one bad sample cannot make Energon drop the
   whole packing buffer.
3. `select_samples_to_pack` — vlpack's `OnlinePlanner` plans the buffer as one final round
   (all algorithms, token and ViT-patch budgets); the markers ride along in the first group.
4. `pack_selected_samples` (stateless) — the trainer's row (`batch.packed_row`) of the group's good samples.
5. `batch` (stateless) — one packed row per batch: a `PackedRow` (the `ThdBatch` and where the
   row's samples went: packed, truncated, skipped by reason).

Energon drops what selection leaves out of a buffer, so there is no carry-over of underfilled
bins as on the JSONL path: each buffer is planned on its own.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron.energon import (
    Cooker,
    Sample,
    TaskEncoder,
    WorkerConfig,
    basic_sample_keys,
    edataclass,
    stateless,
)
from megatron.energon.errors import FatalSampleError

from vlpack.config import DataConfig
from vlpack.data.admission import PACK, SKIP, Admission, BadLimits, DataLimitError
from vlpack.data.batch import ThdBatch, packed_row
from vlpack.data.media import DataFile
from vlpack.data.plan import OnlinePlanner, check_algo
from vlpack.data.sources import parse_record
from vlpack.data.types import BadSampleError, EncodedSample, printable

log = logging.getLogger(__name__)

PACKED, TRUNCATED = "packed", "truncated"
"""`status` of a sample that goes into a row; any other status is a skip reason."""

_ACCOUNT_ATTR = "_vlpack_energon_account"
"""Carries a row's accounting from `pack_selected_samples` to `batch` (same worker process)."""

_SEED_STRIDE = 1_000_033
"""Buffer k of rank r plans with seed + stride·(k·world_size + r): buffer 0 of rank 0 uses the
run's seed itself, as the JSONL planner's first round does."""


@edataclass
class ConversationSample(Sample):
    """A cooked sample: the record (None when its JSON did not parse) and its images' and
    videos' bytes by member name (`img0.jpg`, `vid0.mp4`, `vid1f000.jpg`, ...)."""

    record: Any
    media: dict


@edataclass
class EncodedEnergonSample(Sample):
    """`encode_sample`'s output: the encoded sample and its status (`packed`, `truncated`, or
    the skip reason, with `encoded` None and the error's message in `message`)."""

    encoded: Any
    status: str
    message: str = ""


@stateless
def cook_conversation(sample: dict) -> ConversationSample:
    """Crude tar sample (raw bytes per member) → `ConversationSample`."""
    try:
        record = json.loads(sample["json"])
    except (KeyError, ValueError):
        record = None
    media = {k: v for k, v in sample.items() if k.startswith(("img", "vid"))}
    return ConversationSample(**basic_sample_keys(sample), record=record, media=media)


@dataclass
class PackedRow:
    """What the Energon loader yields per batch: one packed row and the fate of its samples.

    `filler` rows carry no sample (every sample of their group was skipped); the loader counts
    them and does not hand them to training. `examples` holds, per skip reason, the message of
    one sample skipped for it (the loader's summary names it)."""

    batch: ThdBatch
    packed: int = 0
    truncated: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    filler: bool = False
    examples: dict[str, str] = field(default_factory=dict)

    def pin_memory(self) -> PackedRow:
        """Called by the DataLoader's pin-memory thread."""
        return PackedRow(self.batch.pin_memory(), self.packed, self.truncated, self.skipped,
                         self.filler, self.examples)


class QwenVLTaskEncoder(TaskEncoder):
    """Energon task encoder that packs Qwen-VL conversations into vlpack `ThdBatch` rows.

    Args:
      encoder: vlpack's `Encoder` (family, tokenizer, pixel range).
      d: the data section: seq_len (tokens per row and the cap on one sample), packing (the
        planner), max_patches, pad_to_multiple_of, pad_to_seq_len, overlong (as on the JSONL
        path), mrope_after_video, max_consecutive_bad (counted within one worker).
      seed: the run's seed (per-buffer planner seeds derive from it).
      pad_token_id / spatial_merge_size: the model's, as `build_thd_batch` takes them.
    """

    cookers = (Cooker(cook_conversation),)
    decoder = None  # raw bytes: vlpack's Encoder decodes and resizes the images itself

    def __init__(self, encoder, d: DataConfig, *, seed: int, pad_token_id: int,
                 spatial_merge_size: int = 2):
        check_algo(d.packing)
        self._admission = Admission.of(d)
        self._limits = BadLimits.of(d)  # bad() and good() only: the fraction is the loader's
        self.encoder, self.data = encoder, d
        self.seed, self.pad_token_id, self.merge = seed, pad_token_id, spatial_merge_size

    # ------------------------------------------------------------------ stage 2: encode

    @stateless
    def encode_sample(self, sample: ConversationSample) -> EncodedEnergonSample:
        """vlpack's encoding and overlong policy; a bad sample becomes a marker, not an error.
        Any other exception a sample raises is the bad sample `encode_error`, named with it:
        Energon would drop the sample uncounted."""
        try:
            encoded, status = self._admit(self._encode(sample))
        except FatalSampleError:
            raise
        except Exception as e:
            bad = e if isinstance(e, BadSampleError) else BadSampleError(
                "encode_error", f"{sample.__key__}: {type(e).__name__}: {e}")
            # Not printed here: Energon encodes a sample again for each buffer and worker that
            # reads it; the loader prints one line per reason for the skips its rows count.
            log.debug("skipping sample (%s): %s", bad.reason, printable(str(bad)))
            self._count_bad(bad)
            return EncodedEnergonSample.derive_from(sample, encoded=None, status=bad.reason,
                                                    message=str(bad))
        self._limits.good()
        return EncodedEnergonSample.derive_from(sample, encoded=encoded, status=status)

    def _encode(self, sample: ConversationSample) -> EncodedSample:
        record = sample.record
        if not isinstance(record, dict):
            raise BadSampleError("bad_json", f"{sample.__key__}: the sample's .json member is "
                                 "missing or not a JSON object; re-run vlpack data energon-prepare")
        key = str(record.get("id") or sample.__key__)
        # Encoder reads images and videos by path: spill this sample's bytes to a private
        # scratch folder (RAM-backed where /dev/shm exists) so parse_record and Encoder run
        # unchanged.
        with tempfile.TemporaryDirectory(prefix="vlpack-", dir=_scratch_root()) as tmp:
            for name, payload in sample.media.items():
                if "/" not in name:
                    (Path(tmp) / name).write_bytes(payload)
            return self.encoder.encode(parse_record(record, file=DataFile(Path(tmp)), key=key))

    def _admit(self, sample: EncodedSample) -> tuple[EncodedSample, str]:
        """The overlong policy of the JSONL path (`admission.Admission`), on an encoded sample."""
        try:
            verdict, why = self._admission.judge(sample.key, len(sample), sample.num_patches)
        except DataLimitError as e:
            raise FatalSampleError(str(e)) from None
        if verdict == SKIP:
            raise BadSampleError("overlong", why)
        if verdict == PACK:
            return sample, PACKED
        return self.encoder.truncate(sample, self.data.seq_len), TRUNCATED

    def _count_bad(self, e: BadSampleError) -> None:
        try:  # the run of bad samples this worker has seen (Energon's workers run apart)
            self._limits.bad(e.reason, str(e), {})
        except DataLimitError as err:
            raise FatalSampleError(str(err)) from None

    # ------------------------------------------------------------------ stage 3: select

    def select_samples_to_pack(
        self, samples: list[EncodedEnergonSample]
    ) -> list[list[EncodedEnergonSample]]:
        """Plan the buffer with vlpack's planner; markers (skipped samples) join the first group
        so their count reaches the loader. Never raises for a sample."""
        good, bad = [], []
        for s in samples:
            (good if s.encoded is not None and self._fits(s.encoded) else bad).append(s)
        for s in bad:
            if s.encoded is not None:  # cannot happen after encode_sample; never fail the buffer
                s.encoded, s.status = None, "overlong"
        groups: list[list[EncodedEnergonSample]] = []
        if good:
            planner = OnlinePlanner(self.data.seq_len, self.data.packing, len(good) + 1,
                                    max_patches=self.data.max_patches, seed=self._buffer_seed())  # fmt: skip
            planner.extend(range(len(good)), [self._aligned(s.encoded) for s in good],
                           [s.encoded.num_patches for s in good])  # fmt: skip
            groups = [[good[i] for i in b] for b in planner.flush()]
        if bad:
            if groups:
                groups[0].extend(bad)
            else:
                groups.append(bad)
        return groups

    def _aligned(self, sample: EncodedSample) -> int:
        mult = self.data.pad_to_multiple_of
        return -(-len(sample) // mult) * mult

    def _fits(self, sample: EncodedSample) -> bool:
        d = self.data
        return self._aligned(sample) <= d.seq_len and (
            d.max_patches is None or sample.num_patches <= d.max_patches
        )

    def _buffer_seed(self) -> int:
        """Planner seed of this buffer: distinct per rank, worker and buffer, and restored with
        Energon's state (the pre-packing index is part of it)."""
        wc = WorkerConfig.active_worker_config
        rank, world = (wc.rank, wc.world_size) if wc is not None else (0, 1)
        index = self.current_sample_index if wc is not None else 0
        return self.seed + _SEED_STRIDE * (index * world + rank)

    # ------------------------------------------------------------------ stages 4-5: pack, batch

    @stateless
    def pack_selected_samples(self, samples: list[EncodedEnergonSample]) -> ThdBatch:
        """One THD row from the group's good samples (`build_thd_batch`, the one owner)."""
        good = [s.encoded for s in samples if s.encoded is not None]
        status = Counter(s.status for s in samples)
        examples: dict[str, str] = {}
        for s in samples:
            if s.encoded is None:
                examples.setdefault(s.status, s.message)
        batch = packed_row(good or [EncodedSample.filler(self.pad_token_id)], self.data,
                           pad_token_id=self.pad_token_id, spatial_merge_size=self.merge)
        setattr(batch, _ACCOUNT_ATTR, (status, not good, examples))
        return batch

    @stateless
    def batch(self, samples: list[ThdBatch]) -> PackedRow:
        """A batch is one packed row (Energon's batch_size must be 1)."""
        if len(samples) != 1:
            raise FatalSampleError(
                f"got {len(samples)} packed rows in one batch: build the dataset with batch_size=1 "
                "(one row is one micro-batch; use train.micro_batches for more)"
            )
        row = samples[0]
        status, filler, examples = getattr(row, _ACCOUNT_ATTR)
        delattr(row, _ACCOUNT_ATTR)
        skipped = {k: v for k, v in sorted(status.items()) if k not in (PACKED, TRUNCATED)}
        return PackedRow(row, status[PACKED], status[TRUNCATED], skipped, filler, examples)


def _scratch_root() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None
