"""The publish stage and `qpipe registry ls | show | pull`, on a local store and on real S3."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner

from qpipe.export.alias import engine_alias
from qpipe.gpu import NO_GPU
from qpipe.recipe import Recipe, parse_recipe
from qpipe.registry.cli import registry_app
from qpipe.registry.registry import Registry, RegistryError
from qpipe.stages.base import StageContext, StageError
from qpipe.stages.publish import PublishStage
from qpipe.store.base import DocumentExists, Store
from qpipe.store.factory import open_store
from qpipe.store.local import LocalStore

if TYPE_CHECKING:
    from tests.s3_server import S3Server


RECIPE = """
name: smollm2-int8
model: {{source: ./model, name: smollm2}}
calibration: {{dataset: data.jsonl}}
quantization: {{method: int8-sq}}
build: {{targets: [trtllm-checkpoint, compressed-tensors], arch: sm90}}
evaluate: {{max_drop: {{kld_mean: 0.05}}}}
bench: {{}}
publish: {publish}
"""
ALIAS = "smollm2-sm90-int8-tp1"


def recipe(publish: str = "{}") -> Recipe:
    return parse_recipe(RECIPE.format(publish=publish))


def put(store: Store, stage: str, files: dict[str, bytes], **meta: object) -> str:
    key = hashlib.sha256(json.dumps([stage, sorted(files), meta], default=str).encode()).hexdigest()
    with store.writer(key, stage) as tmp:
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        store.commit(
            key, stage, tmp, meta.get("metrics", {}), meta.get("gate"), meta.get("key_inputs", {})
        )
    return key


def upstream(
    store: Store,
    *,
    kld: float = 0.01,
    eval_passed: bool = True,
    compressed: dict[str, bytes] | None = None,
    arch: str = "sm90",
) -> dict[str, str]:
    """Committed convert/calibrate/build/evaluate/bench entries, as a pipeline run leaves them
    (the build's arch as the build stage records it: "none" on a machine without a GPU)."""
    build_info = {
        "targets": ["trtllm-checkpoint", "compressed-tensors"],
        "arch": arch,
        "tp": 1,
        "pp": 1,
        "quant": "int8",
        "alias": engine_alias(recipe(), arch),
    }
    compressed = compressed or {"config.json": b"{}", "model.safetensors": b"ct-weights"}
    return {
        "convert": put(
            store,
            "convert",
            {"model.safetensors": b"fp32-weights", "config.json": b"{}"},
            key_inputs={"files": {"/models/smollm2/model.safetensors": "5eed" * 16}},
        ),
        "calibrate": put(store, "calibrate", {"calibration.safetensors": b"tokens"}),
        "build": put(
            store,
            "build",
            {
                "trtllm-checkpoint/config.json": b'{"architecture": "LlamaForCausalLM"}',
                "trtllm-checkpoint/rank0.safetensors": b"rank0-weights",
                **{f"compressed-tensors/{rel}": data for rel, data in compressed.items()},
                "build.json": json.dumps(build_info).encode(),
            },
        ),
        "evaluate": put(
            store,
            "evaluate",
            {"report.json": b"{}"},
            metrics={"kld": kld, "top1_agreement": 0.97},
            gate={
                "passed": eval_passed,
                "failures": [] if eval_passed else [f"kld {kld} > allowed 0.05"],
                "checked": {"kld": kld},
            },
        ),
        "bench": put(
            store,
            "bench",
            {"results.json": b"{}"},
            metrics={"output_throughput": 850.0},
            gate={"passed": True, "failures": [], "checked": {}},
        ),
    }


def publish(store: Store, keys: dict[str, str], tmp_path: Path, publish_yaml: str = "{}") -> dict:
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    out.mkdir()
    ctx = StageContext(
        recipe=recipe(publish_yaml),
        recipe_dir=tmp_path,
        out_dir=out,
        inputs={"build": store.open(keys["build"])},
        store=store,
        keys={"quantize": "9" * 64, **keys},
    )
    result = PublishStage().run(ctx)
    summary = json.loads((out / "publish.json").read_text())
    assert summary["version"] == result.metrics["version"]
    return summary


def test_publish_writes_a_manifest_with_lineage_results_and_targets(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    keys = upstream(store)
    summary = publish(store, keys, tmp_path)
    assert summary["version"] == "1" and summary["new_version"] is True

    registry = Registry(store)
    assert registry.names() == ["smollm2-int8"] and registry.latest("smollm2-int8") == "1"
    manifest = registry.read("smollm2-int8", "1")
    assert [(a.target, a.key, a.alias, a.arch, a.files) for a in manifest.artifacts] == [
        ("trtllm-checkpoint", keys["build"], ALIAS, "sm90", 2),
        ("compressed-tensors", keys["build"], ALIAS, "sm90", 2),
    ]
    lineage = manifest.lineage
    assert lineage.stage_keys["build"] == keys["build"] and lineage.stage_keys["quantize"]
    assert lineage.source == {"/models/smollm2/model.safetensors": "5eed" * 16}
    calibration = store.lookup(keys["calibrate"]).files["calibration.safetensors"].sha256
    assert lineage.calibration_set_sha256 == calibration
    assert (
        lineage.checkpoint_sha256["model.safetensors"]
        == hashlib.sha256(b"fp32-weights").hexdigest()
    )
    assert manifest.accuracy.metrics["kld"] == 0.01 and manifest.accuracy.key == keys["evaluate"]
    assert manifest.throughput.metrics["output_throughput"] == 850.0
    assert manifest.recipe["quantization"]["method"] == "int8-sq"
    assert manifest.environment["python"] and manifest.failed_gates_allowed == []
    assert store.read_document("registry/smollm2-int8/latest") == b'{"version": "1"}'


def test_versions_are_immutable_and_republishing_is_idempotent(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    keys = upstream(store)
    assert publish(store, keys, tmp_path)["version"] == "1"
    again = publish(store, keys, tmp_path)
    assert again["version"] == "1" and again["new_version"] is False

    better = upstream(store, kld=0.005)
    assert publish(store, better, tmp_path)["version"] == "2"
    assert Registry(store).versions("smollm2-int8") == ["1", "2"]
    assert publish(store, keys, tmp_path)["version"] == "1"  # the old content still is v1
    # and is what consumers get again: re-running a recipe after another one (a revert)
    assert Registry(store).latest("smollm2-int8") == "1"
    assert publish(store, better, tmp_path)["version"] == "2"
    assert Registry(store).latest("smollm2-int8") == "2"

    # a mirror: pushing an older version adds it without moving the mirror's latest back
    mirror = Registry(LocalStore(tmp_path / "mirror"))
    Registry(store).push("smollm2-int8@2", mirror)
    Registry(store).push("smollm2-int8@1", mirror)
    assert mirror.versions("smollm2-int8") == ["1", "2"] and mirror.latest("smollm2-int8") == "2"

    assert publish(store, keys, tmp_path, "{version: 2026.11-rc1}")["version"] == "2026.11-rc1"
    with pytest.raises(StageError, match="already exists with other content"):
        publish(store, upstream(store, kld=0.004), tmp_path, "{version: 2026.11-rc1}")


def test_a_publish_whose_registry_moved_on_or_lost_it_is_stale(tmp_path: Path) -> None:
    """The publish stage's effect lives in the registry: a cached publish is run again when the
    registry's latest points elsewhere (another recipe published since) or lost it."""
    store = LocalStore(tmp_path / "store")
    keys = upstream(store)
    publish(store, keys, tmp_path)
    entry = tmp_path / "out-0"  # the first publish's output: what its cached entry holds
    stage, published = PublishStage(), recipe()
    assert stage.stale(published, entry, store) is None
    publish(store, upstream(store, kld=0.005), tmp_path)  # v2 becomes latest
    assert "latest is 2" in (stage.stale(published, entry, store) or "")
    publish(store, keys, tmp_path)  # the revert: latest is v1 again
    assert stage.stale(published, entry, store) is None
    for doc in store.list_documents("registry/"):
        (store.local_root / "docs" / doc).unlink()
    assert "has no smollm2-int8 any more" in (stage.stale(published, entry, store) or "")


def test_gc_keep_recipe_keeps_what_published_versions_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from qpipe import cli

    store = LocalStore(tmp_path / "store")
    keys = upstream(store)
    publish(store, keys, tmp_path)
    published = Registry(store).referenced_keys()
    assert keys["build"] in published and keys["evaluate"] in published
    nothing = SimpleNamespace(plan=lambda: [])  # a kept recipe that uses none of them
    monkeypatch.setattr(cli, "_pipeline", lambda path, store: nothing)
    gc = CliRunner().invoke(
        cli.app, ["cache", "gc", "--keep-recipe", "r.yaml", "--store", str(store.root)]
    )
    assert gc.exit_code == 0, gc.output
    assert all(store.lookup(key) is not None for key in published)
    assert f"removed objects/{keys['convert']}" in gc.output  # what nothing names still goes
    pulled = CliRunner().invoke(registry_app, ["pull", "smollm2-int8", "--target",
                                               "compressed-tensors",
                                               "--to", str(tmp_path / "pulled"),
                                               "--store", str(store.root)])  # fmt: skip
    assert pulled.exit_code == 0, pulled.output


def test_failed_gates_refuse_publishing_unless_allowed_and_then_recorded(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    keys = upstream(store, kld=0.09, eval_passed=False)
    with pytest.raises(StageError, match=r"(?s)kld 0.09 > allowed 0.05.*--allow-failed-gates"):
        publish(store, keys, tmp_path)
    assert Registry(store).names() == []

    summary = publish(store, keys, tmp_path, "{allow_failed_gates: true}")
    assert summary["failed_gates_allowed"] == ["evaluate: kld 0.09 > allowed 0.05"]
    shown = CliRunner().invoke(
        registry_app, ["show", "smollm2-int8@1", "--store", str(tmp_path / "store")]
    )
    assert shown.exit_code == 0, shown.output
    assert "published despite failed gate: evaluate: kld 0.09 > allowed 0.05" in shown.output


def test_registry_cli_on_s3_pulls_exactly_one_verified_artifact(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QPIPE_HOME", str(tmp_path / "ci-home"))
    local = LocalStore(tmp_path / "builder")
    keys = upstream(local)
    bucket = s3_env.bucket()
    registry_url = f"s3://{bucket}/registry"
    summary = publish(local, keys, tmp_path, f"{{registry: '{registry_url}'}}")
    assert summary["registry"] == registry_url  # the entries were copied there

    runner = CliRunner()
    listed = runner.invoke(registry_app, ["ls", "--store", registry_url, "--json"])
    assert listed.exit_code == 0, listed.output
    assert [(r["name"], r["latest"]) for r in json.loads(listed.stdout)] == [("smollm2-int8", "1")]
    shown = runner.invoke(registry_app, ["show", "smollm2-int8", "--store", registry_url, "--json"])
    assert json.loads(shown.stdout)["artifacts"][0]["key"] == keys["build"]

    dest = tmp_path / "engine"
    args = ["pull", "smollm2-int8@1", "--target", "trtllm-checkpoint", "--arch", "sm90"]
    pulled = runner.invoke(registry_app, [*args, "--to", str(dest), "--store", registry_url])
    assert pulled.exit_code == 0, pulled.output
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "rank0.safetensors"]
    assert (dest / "rank0.safetensors").read_bytes() == b"rank0-weights"

    wrong = runner.invoke(
        registry_app,
        [
            "pull",
            "smollm2-int8",
            "--target",
            "trtllm-engine",
            "--to",
            str(tmp_path / "x"),
            "--store",
            registry_url,
        ],  # fmt: skip
    )
    assert wrong.exit_code == 1 and "has no trtllm-engine artifact" in wrong.output
    assert "trtllm-checkpoint (sm90)" in wrong.output

    mirror = f"s3://{bucket}/mirror"
    for _ in range(2):  # a second push finds everything there
        pushed = runner.invoke(
            registry_app, ["push", "smollm2-int8", "--to", mirror, "--store", registry_url]
        )
        assert pushed.exit_code == 0, pushed.output
    assert "already there: smollm2-int8@1" in pushed.output
    assert Registry(open_store(mirror)).read("smollm2-int8").store == mirror

    marker = json.loads(s3_env.client().get_object(
        Bucket=bucket, Key=f"registry/entries/{keys['build']}.json")["Body"].read())  # fmt: skip
    s3_env.client().put_object(
        Bucket=bucket,
        Key=f"registry/blobs/{keys['build']}/{marker['upload']}/trtllm-checkpoint/rank0.safetensors",
        Body=b"rank0-weightZ",
    )
    fleet = Registry(open_store(registry_url))
    fleet.store.cache.remove(keys["build"])
    with pytest.raises(RegistryError, match="does not match its checksum"):
        fleet.pull("smollm2-int8", "trtllm-checkpoint", tmp_path / "corrupt")
    assert not (tmp_path / "corrupt").exists()  # nothing half-verified is left behind


def test_a_cpu_build_is_cpu_in_the_alias_the_registry_and_pull_arch(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    keys = upstream(store, arch=NO_GPU)  # what build.json says when no GPU was detected
    publish(store, keys, tmp_path)
    manifest = Registry(store).read("smollm2-int8")
    alias = engine_alias(recipe(), NO_GPU)
    assert alias == "smollm2-cpu-int8-tp1"
    assert [(a.target, a.arch, a.alias) for a in manifest.artifacts] == [
        ("trtllm-checkpoint", "cpu", alias),
        ("compressed-tensors", "cpu", alias),
    ]

    runner = CliRunner()
    listed = runner.invoke(registry_app, ["ls", "--store", str(store.root), "--json"])
    assert json.loads(listed.stdout)[0]["targets"] == [
        "trtllm-checkpoint@cpu",
        "compressed-tensors@cpu",
    ]
    for arch in (["--arch", "cpu"], ["--arch", "none"], []):  # without --arch: any arch
        dest = tmp_path / f"pulled{''.join(arch) or '-any'}"
        args = ["pull", "smollm2-int8", "--target", "compressed-tensors", *arch, "--to", str(dest)]
        pulled = runner.invoke(registry_app, [*args, "--store", str(store.root)])
        assert pulled.exit_code == 0, pulled.output
        assert "(cpu, 2 files" in pulled.output
        assert (dest / "model.safetensors").read_bytes() == b"ct-weights"
    wrong = runner.invoke(
        registry_app,
        ["pull", "smollm2-int8", "--target", "compressed-tensors", "--arch", "sm90",
         "--to", str(tmp_path / "x"), "--store", str(store.root)],
    )  # fmt: skip
    assert wrong.exit_code == 1 and "compressed-tensors (cpu)" in wrong.output


def test_registries_that_recorded_a_cpu_build_as_none_keep_working(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    keys = upstream(store, arch=NO_GPU)
    publish(store, keys, tmp_path)
    doc = "registry/smollm2-int8/1/manifest.json"
    old = json.loads(store.read_document(doc))
    for artifact in old["artifacts"]:
        artifact["arch"] = "none"  # as publish wrote it before arch names were unified
    store.write_document(doc, json.dumps(old).encode())

    registry = Registry(store)
    assert {a.arch for a in registry.read("smollm2-int8").artifacts} == {"cpu"}
    _, record = registry.pull("smollm2-int8", "trtllm-checkpoint", tmp_path / "ckpt", arch="cpu")
    assert record.arch == "cpu" and (tmp_path / "ckpt" / "rank0.safetensors").is_file()
    again = publish(store, keys, tmp_path)  # the same content: still version 1
    assert again["version"] == "1" and again["new_version"] is False


@pytest.mark.slow
def test_real_smollm2_published_and_pulled_loads_identically(
    tmp_path: Path, smollm2_checkpoint: Path
) -> None:
    """The real model through publish -> separate registry store -> pull -> transformers.

    (A local registry: SeaweedFS on 2 shared cores uploads ~30 MB/s, too slow for 540 MB here;
    the S3 path is the same code, exercised above with small artifacts.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    builder = LocalStore(tmp_path / "builder")
    checkpoint = {p.name: p.read_bytes() for p in smollm2_checkpoint.iterdir() if p.is_file()}
    keys = upstream(builder, compressed=checkpoint)
    registry_dir = tmp_path / "registry"
    publish(builder, keys, tmp_path, f"{{registry: '{registry_dir}'}}")

    dest = tmp_path / "serving" / "smollm2"
    _, record = Registry(LocalStore(registry_dir)).pull("smollm2-int8", "compressed-tensors", dest)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == checkpoint
    assert record.size == sum(len(data) for data in checkpoint.values())

    tokenizer = AutoTokenizer.from_pretrained(dest)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(dest).eval()(ids).logits
    assert tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_pull_to_a_file_or_under_a_file_is_refused_with_the_path(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    publish(store, upstream(store), tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    runner = CliRunner()
    for to, expected in (
        (afile, f"{afile} is a file, not a directory"),
        (afile / "x", f"cannot create the directory {afile} ("),
    ):
        args = ["pull", "smollm2-int8", "--target", "compressed-tensors", "--to", str(to)]
        result = runner.invoke(registry_app, [*args, "--store", str(store.root)])
        assert result.exit_code == 1, result.output
        assert expected in result.output and "pull into a new directory" in result.output
    assert afile.read_text() == "not a directory"


def race_two_publishes(first: Store, second: Store, tmp_path: Path) -> None:
    """`first` reads the versions, then `second` (another process's view of the same registry)
    publishes other content before `first` writes: both must end up as versions, intact."""
    first_keys, second_keys = upstream(first), upstream(second, kld=0.005)
    read_versions = first.list_documents

    def list_then_lose_the_race(prefix: str) -> list[str]:
        found = read_versions(prefix)
        if prefix == "registry/smollm2-int8/" and not raced:
            raced.append(publish(second, second_keys, tmp_path))
        return found

    raced: list[dict] = []
    first.list_documents = list_then_lose_the_race  # type: ignore[method-assign]
    won_first = publish(first, first_keys, tmp_path)
    assert raced[0]["version"] == "1" and raced[0]["new_version"] is True
    assert won_first["version"] == "2" and won_first["new_version"] is True
    registry = Registry(second)
    assert registry.versions("smollm2-int8") == ["1", "2"]
    assert registry.read("smollm2-int8", "1").accuracy.metrics["kld"] == 0.005
    assert registry.read("smollm2-int8", "2").accuracy.metrics["kld"] == 0.01


def test_concurrent_publishes_of_one_name_get_distinct_versions(tmp_path: Path) -> None:
    race_two_publishes(LocalStore(tmp_path / "store"), LocalStore(tmp_path / "store"), tmp_path)


def test_concurrent_publishes_to_s3_get_distinct_versions(s3_env: S3Server, tmp_path: Path) -> None:
    from qpipe.store.s3 import S3Store
    from qpipe.store.tiered import TieredStore

    bucket = s3_env.bucket()
    for prefix, tiered in (("registry", False), ("two-tier", True)):  # plain S3; local + S3
        url = f"s3://{bucket}/{prefix}"
        first, second = (S3Store(url, LocalStore(tmp_path / f"{prefix}-{m}")) for m in "ab")
        if tiered:
            first, second = TieredStore(first), TieredStore(second)
        race_two_publishes(first, second, tmp_path)


def test_a_version_created_meanwhile_is_never_overwritten(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.create_document("registry/x/1/manifest.json", b"first")
    with pytest.raises(DocumentExists, match="registry/x/1/manifest.json already exists"):
        store.create_document("registry/x/1/manifest.json", b"second")
    assert store.read_document("registry/x/1/manifest.json") == b"first"
    assert store.list_documents("registry/") == ["registry/x/1/manifest.json"]  # no temp left


def test_a_pull_removes_what_an_interrupted_pull_to_the_same_dest_left(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    publish(store, upstream(store), tmp_path)
    killed = tmp_path / "serving" / ".model.partial-0badf00d"  # a pull killed mid-download
    (killed / "sub").mkdir(parents=True)
    (killed / "sub" / "model.safetensors").write_bytes(b"half")
    other = tmp_path / "serving" / ".other.partial-0badf00d"  # another destination's
    other.mkdir()
    Registry(store).pull("smollm2-int8", "compressed-tensors", tmp_path / "serving" / "model")
    assert sorted(p.name for p in (tmp_path / "serving").iterdir()) == [
        ".other.partial-0badf00d",
        "model",
    ]
