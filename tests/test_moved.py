"""0.1's flat module paths still import, for one release, with a DeprecationWarning; every
name they defined resolves there to the object at its new home."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from raypipe._moved import ELSEWHERE, MOVED, _resolve

# the top-level names each 0.1 module defined (tar_label_members: dead code, removed)
OLD_NAMES = {
    "blocks": "Columns block_columns dataset_columns execute",
    "blocksize": "BLOCK_SHARE BLOCK_TARGET log sized_blocks",
    "budget": "SkipBudgetError check_budget skip_limit",
    "checkpoint": "EpochBatches Progress USER_STATE load_checkpoint",
    "classify": "RunConfig TrainerSettings classify_loop evaluate format_epoch run small_cnn",
    "collate": "collate_for pad_collate",
    "demo": "DIGIT_SIZE photo_crops write_demo_data write_digits write_photos",
    "device_ops": "CudaOps Event Ops SyncOps default_ops",
    "epochs": "PROGRESS_S Pipeline",
    "examples": "ColorCrop",
    "fastimage": "crop_resize decode_crop exif_orientation fast_decodable jpeg_size",
    "feeder": "Columns Feeder STAGES shuffled",
    "follow": "Demand Follower FollowingAutoscaler FollowingCluster RAY_VERSION SERIES check_ray follow follower_for log",
    "gpudecode": "DeviceDecode Encoded EncodedBlocks PLAN_FIELDS collate_encoded crop_resize decode_rgb device_map_for resample",
    "h2d": "Batch HostToDevice PinnedRing Transfer",
    "jobspec": "Kind PATH_KEYS RUN_SECTIONS check kind_of resolve resolve_paths write_resolved",
    "ledger": "EpochLedger Gate create_ledger",
    "parquetfiles": "ROWS_PER_READ count_parquet_rows parquet_labels read_parquet",
    "pipeline": "LOGGED_SKIPS Preprocessor SKIPS_PER_SEND build_dataset log preprocess_task",
    "plan": "RankPlan epoch_keys",
    "poolwatch": "PLANNED PoolSample PoolWatch",
    "progress": "Progress",
    "rebatch": "concat_column rebatch",
    "resume": "Delivered PipelineState STATE_FILE fingerprint merge_states pending_rows unpack_done",
    "shard_writer": "EXTENSIONS Sample Written count_samples write_shard",
    "shardfiles": "LABEL_MEMBERS RawSample WDS_IMAGE_EXTS count_tar_samples os_error read_tar",
    "shards": "INDEX ShardsConfig Summary plan preprocess shard_name",
    "skips": "ACTOR_NAME BadSample MAX_RUNS REASONS REPORT_FILE SampleError SkipLog SkipRecord SkipStore detail_of reason_of write_reports",
    "sources": "IMAGE_EXTS Listing PROGRESS_S Reader Shard epoch_order infer_format list_shards read_shard",
    "stats": "IterStats STAGE_NAMES WAITS_BELOW bound",
    "storage": "READ_BUFFER S3_ALIASES S3_ATTEMPTS S3_DEFAULTS Storage StorageError is_remote",
    "submit": "DEFAULT_ADDRESS ENTRY EXCLUDES SubmitError TERMINAL entrypoint job_address submit",
    "survey": "format_survey survey",
    "transforms": "Box EVAL_CROP_FRACTION Plan center_box decode_crop plan random_resized_box sample_rng to_rgb",
    "usermap": "INPUTS SampleMap TransformOutputError resolve_callable seed_globals",
    "userrows": "RowBuilder Schema rows_block",
    "warm": "RankPreprocessor rank_dataset rank_pool rank_task task_table",
}


def test_every_old_module_is_listed():
    assert set(OLD_NAMES) == {m.removeprefix("raypipe.") for m in MOVED}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_keeps_its_names(old):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert any(
        issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message) for w in caught
    ), [str(w.message) for w in caught]
    new = importlib.import_module(MOVED[old])
    elsewhere = ELSEWHERE.get(old, {})
    for name in OLD_NAMES[old.removeprefix("raypipe.")].split():
        found = getattr(module, name)  # AttributeError: a name lost
        expected = _resolve(elsewhere[name]) if name in elsewhere else getattr(new, name)
        assert found is expected, (old, name)


def test_a_name_never_defined_is_an_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sources = importlib.import_module("raypipe.sources")
    with pytest.raises(AttributeError, match="raypipe.sources.*no_such_name"):
        sources.no_such_name  # noqa: B018


def test_old_read_shard_reads_a_shard(datasets):
    from raypipe._moved import read_shard

    tar = sorted(datasets["webdataset"].glob("*.tar"))[0]
    samples = list(read_shard(str(tar), "webdataset", 100, -1))
    assert samples and [s.key for s in samples] == list(range(100, 100 + len(samples)))
