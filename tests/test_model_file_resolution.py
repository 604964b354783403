"""GGUF file patterns (model_file, mmproj, spec_draft_model) resolved in a model directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from solar_host.backends.files import resolve_model_file
from solar_host.instances.schemas import ConfigError, parse_config


def touch(path: Path, size: int = 10) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    return path


def test_absolute_existing_and_missing(tmp_path):
    f = touch(tmp_path / "m.gguf")
    assert resolve_model_file(tmp_path / "elsewhere", str(f)) == f
    with pytest.raises(FileNotFoundError):
        resolve_model_file(tmp_path, str(tmp_path / "missing.gguf"))


def test_exact_relative_path(tmp_path):
    f = touch(tmp_path / "sub" / "m-Q4.gguf")
    touch(tmp_path / "sub" / "m-Q4.gguf.bak", 100)
    assert resolve_model_file(tmp_path, "sub/m-Q4.gguf") == f


def test_root_glob_picks_matching_file(tmp_path):
    ud = touch(tmp_path / "Model-UD-Q4_K_XL.gguf", 50)
    touch(tmp_path / "Model-Q8_0.gguf", 100)
    assert resolve_model_file(tmp_path, "*UD-Q4*") == ud


def test_bare_filename_found_in_subdirectory(tmp_path):
    f = touch(tmp_path / "Q4_K_M" / "model.gguf")
    assert resolve_model_file(tmp_path, "model.gguf") == f


def test_glob_matches_nested_file(tmp_path):
    f = touch(tmp_path / "a" / "b" / "Model-Q6_K.gguf")
    assert resolve_model_file(tmp_path, "*Q6_K*.gguf") == f


def test_root_match_wins_over_larger_nested(tmp_path):
    root = touch(tmp_path / "m-Q4.gguf", 10)
    touch(tmp_path / "sub" / "big-Q4.gguf", 1000)
    assert resolve_model_file(tmp_path, "*Q4*.gguf") == root


def test_split_shards_pick_first(tmp_path):
    first = touch(tmp_path / "M-Q8_0-00001-of-00003.gguf", 10)
    touch(tmp_path / "M-Q8_0-00002-of-00003.gguf", 500)
    touch(tmp_path / "M-Q8_0-00003-of-00003.gguf", 500)
    assert resolve_model_file(tmp_path, "*Q8_0*") == first


def test_largest_wins_and_equal_sizes_are_ambiguous(tmp_path):
    touch(tmp_path / "a-Q4.gguf", 10)
    big = touch(tmp_path / "b-Q4.gguf", 20)
    assert resolve_model_file(tmp_path, "*Q4*") == big
    touch(tmp_path / "c-Q5.gguf", 30)
    touch(tmp_path / "d-Q5.gguf", 30)
    with pytest.raises(ValueError, match="ambiguous"):
        resolve_model_file(tmp_path, "*Q5*")


def test_no_match_and_directory_named_like_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match="No file matching"):
        resolve_model_file(tmp_path, "*nothing*")
    (tmp_path / "model.gguf").mkdir()
    with pytest.raises(FileNotFoundError):
        resolve_model_file(tmp_path, "model.gguf")


def test_pattern_never_leaves_base_dir(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    touch(tmp_path / "secret.gguf")
    with pytest.raises(ValueError, match=r"\.\."):
        resolve_model_file(base, "../secret.gguf")
    (base / "link.gguf").symlink_to(tmp_path / "secret.gguf")
    with pytest.raises(FileNotFoundError):
        resolve_model_file(base, "link.gguf")


def test_glob_characters_in_directory_name(tmp_path):
    base = tmp_path / "hf--org--Model[v2]"
    f = touch(base / "Model-Q4.gguf")
    assert resolve_model_file(base, "*Q4*") == f


# --- parse_config -------------------------------------------------------------------------------


@pytest.fixture
def snapshot(tmp_path):
    """A pulled HF repo with several quantizations, an mmproj and a draft model."""
    models = tmp_path / "models"
    repo = models / "hf--org--model"
    touch(repo / "model-Q4_K_M.gguf", 40)
    touch(repo / "model-Q8_0.gguf", 80)
    touch(repo / "mmproj-F16.gguf", 5)
    touch(repo / "draft" / "draft-Q4.gguf", 7)
    return models, repo


def lookup_for(repo: Path):
    return lambda source: repo if source == "huggingface://org/model" else None


def test_manifest_snapshot_resolves_every_pattern(snapshot):
    models, repo = snapshot
    c = parse_config(
        {
            "backend_type": "llamacpp",
            "alias": "m",
            "model": str(repo),
            "model_source": "huggingface://org/model",
            "model_file": "*Q8_0*",
            "mmproj": "mmproj-F16.gguf",
            "spec_type": "draft-dspark",
            "spec_draft_model": "draft-Q4.gguf",
        },
        models_dir=models,
        manifest_lookup=lookup_for(repo),
    )
    assert c.model == str(repo / "model-Q8_0.gguf")
    assert c.mmproj == str(repo / "mmproj-F16.gguf")
    assert c.spec_draft_model == str(repo / "draft" / "draft-Q4.gguf")
    assert c.model_source == "huggingface://org/model"


def test_local_source_with_model_file(tmp_path):
    models = tmp_path / "models"
    f = touch(models / "local-repo" / "x-Q8_0.gguf")
    touch(models / "local-repo" / "x-Q4_0.gguf")
    c = parse_config(
        {"alias": "l", "model_source": "local://local-repo", "model_file": "*Q8_0*"},
        models_dir=models,
    )
    assert c.model == str(f)


def test_unresolvable_strict_and_lenient(snapshot):
    models, repo = snapshot
    raw = {
        "backend_type": "llamacpp",
        "alias": "m",
        "model": str(repo / "model-Q4_K_M.gguf"),
        "model_file": "*Q2_K*",
    }
    with pytest.raises(ConfigError, match="Cannot resolve model_file pattern"):
        parse_config(raw, models_dir=models)
    c = parse_config(raw, models_dir=models, strict=False)
    assert c.model == str(repo / "model-Q4_K_M.gguf")


def test_absolute_model_without_pattern_untouched(snapshot):
    models, repo = snapshot
    path = str(repo / "model-Q4_K_M.gguf")
    c = parse_config({"alias": "m", "model": path, "mmproj": ""}, models_dir=models)
    assert c.model == path and c.mmproj is None
