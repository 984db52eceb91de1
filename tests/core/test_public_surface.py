"""The top-level public surface is an allowlist: the spec's re-exports plus the five first calls (issue #20)."""

from __future__ import annotations

import composer_replication as cr

SPEC = {"__version__", "_DILOCO_AVAILABLE", "compose_loss", "LossConfig", "LossComponents", "build_batch",
        "generalized_jsd_loss", "ClaudeCodeIngester", "IngestionStats", "SYSTEM_PROMPT", "DEFAULT_TEACHERS", "DPOPair",
        "TeacherCallResult", "TeacherSpec", "TraceState", "extract_dpo_pairs", "replay_trace",
        "ComposerReplicationTrainer", "make_diloco_outer_loop"}
FIRST_CALLS = {"ingest_any", "build_training_data", "StudentConfig", "run_plain", "load_model_and_tokenizer"}


def test_the_top_level_names_are_exactly_the_allowlist():
    assert set(cr.__all__) == SPEC | FIRST_CALLS, "a new top-level name is a decision: add it to this allowlist"
    assert len(cr.__all__) == len(set(cr.__all__)) <= 40


def test_every_top_level_name_resolves_to_its_module_object():
    from composer_replication.engine import StudentConfig, run_plain
    from composer_replication.ingestion import ingest_any

    for name in cr.__all__:
        getattr(cr, name)  # lazily imported; make_diloco_outer_loop is None without torchft (the spec)
    assert (cr.run_plain, cr.StudentConfig, cr.ingest_any) == (run_plain, StudentConfig, ingest_any)
    assert "run_plain" in dir(cr)
