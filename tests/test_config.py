"""Configuration: Hydra composition, overrides, and refusal of bad values before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf

from elastic.config import Bound, Config, ConfigError, validate
from launcher.compose import UsageError, finalize, validate_launch
from launcher.compose import compose as compose_launch

from .conftest import REPO


def composed(*overrides: str) -> Config:
    with initialize_config_module(config_module="conf", version_base=None):
        return finalize(OmegaConf.to_object(compose("config", overrides=list(overrides))))


def test_defaults_are_valid() -> None:
    cfg = composed()
    validate(cfg)
    assert cfg.cluster.mode == "local" and cfg.cluster.nodes == 2
    assert cfg.model.name == "resnet18" and cfg.data.synthetic
    assert cfg.checkpoint.url == f"file://{cfg.run_dir}/checkpoints"


def test_overrides_from_the_issue_compose(tmp_path: Path) -> None:
    cfg = composed("cluster.nodes=3", "optim.lr=0.2", f"data.root={tmp_path}", "model=resnet50")
    assert (cfg.cluster.nodes, cfg.optim.lr, cfg.model.name) == (3, 0.2, "resnet50")
    assert cfg.data.root == str(tmp_path)


def test_imagenet_presets_compose() -> None:
    cfg = composed("model=resnet50", "data=imagenet", "optim=goyal", "cluster=bare_metal")
    assert cfg.data.crop_size == 224 and cfg.optim.milestones_epochs == [30, 60, 80]
    assert cfg.cluster.mode == "bare_metal"


@pytest.mark.parametrize(
    ("recipe", "optimizer", "bn_stats", "grad_dtype"),
    [
        ("resnet50_8k_goyal", "sgd", "running", "fp32"),
        ("resnet50_32k_akiba", "akiba", "last_batch", "fp16"),
        ("resnet50_32k_lars", "lars", "running", "bf16"),
    ],
)
def test_recipes_compose_over_the_defaults(
    tmp_path: Path, recipe: str, optimizer: str, bn_stats: str, grad_dtype: str
) -> None:
    """A recipe overrides the groups and the keys of config.yaml itself (trainer.epochs), and
    passes validation once the data set is there."""
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    cfg = composed(f"recipe={recipe}", f"data.root={tmp_path}")
    validate(cfg)
    assert (cfg.model.name, cfg.data.crop_size, cfg.trainer.epochs) == ("resnet50", 224, 90)
    assert (cfg.optim.name, cfg.model.bn_stats, cfg.comm.grad_dtype) == (
        optimizer,
        bn_stats,
        grad_dtype,
    )


def test_the_language_model_recipe_composes_adamw_with_its_cosine_and_clipping() -> None:
    cfg = composed("recipe=lm_1b_adamw")
    validate(cfg)
    o = cfg.optim
    assert (o.name, o.schedule, o.warmup_start, o.policy) == (
        "adamw",
        "cosine",
        "zero",
        "keep_global_batch",
    )
    assert (o.clip_grad_norm, o.adamw.beta2, cfg.trainer.precision) == (1.0, 0.95, "bf16")
    assert [cfg.job[k] for k in ("layers", "dim", "heads")] == [24, 2048, 16]


def test_health_presets_compose() -> None:
    assert composed().health.min_open_files == 4096
    strict = composed("health=strict").health
    assert (strict.min_open_files, strict.fail_on_throttle, strict.max_gpu_temp_c) == (
        65536,
        True,
        80,
    )
    assert strict.gpu_probe_timeout_s == 120.0  # the rest comes from health/default


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["cluster.min_nodes=5", "cluster.nodes=3"], "cluster.min_nodes"),
        (["optim.lr=-1"], "optim.lr"),
        (["optim.momentum=1.5"], "optim.momentum"),
        (["data.batch_size=0"], "data.batch_size"),
        (["rendezvous.lease_ttl_s=1"], "rendezvous.lease_ttl_s"),
        (["model.name=resnet9000"], "model.name"),
        (["checkpoint.every_steps=0"], "checkpoint.every_steps"),
        (["cluster=bare_metal"], "job_id"),
        (["cluster=bare_metal", "job_id=x"], "cluster.etcd_endpoints"),
        (["cluster.etcd_endpoints=[nohostport]"], "cluster.etcd_endpoints"),
        (["data=imagenet", "data.root=/nonexistent/imagenet"], "data.root"),
        (["data=imagenet", "data.root=/nonexistent/imagenet"], "data.val_dir"),
        (["health.min_open_files=-1"], "health.min_open_files"),
        (["health.gpu_memory_fraction=1.5"], "health.gpu_memory_fraction"),
        (["health.quarantine_s=1"], "health.quarantine_s"),
        (["health.max_strikes=0"], "health.max_strikes"),
        (["optim.milestones_epochs=[60,30]"], "optim.milestones_epochs"),
        (["rendezvous.watchdog_s=0"], "rendezvous.watchdog_s"),
        (["rendezvous.settle_s=-1"], "rendezvous.settle_s"),
        (["data.generate.classes=1"], "data.generate.classes"),
        (["optim=lars", "trainer.epochs=90", "optim.nesterov=true"], "optim.nesterov"),
        (["optim=lars"], "optim.warmup_epochs"),  # its 25 warm-up epochs exceed the default 3
        (["optim.gamma=0"], "optim.gamma"),
        (["trainer.epochs=0"], "trainer.epochs"),
        (["cluster.max_nodes=-1"], "cluster.max_nodes"),
        (["health.etcd_timeout_s=0"], "health.etcd_timeout_s"),
        (["job_id=../escape"], "job_id"),
        (["job_id=a/nodes"], "job_id"),
        (["job_id='two words'"], "job_id"),
        (["job_id=x.health"], "job_id"),
        (["cluster.embedded_etcd_members=2"], "cluster.embedded_etcd_members"),
        (["rendezvous.etcd_grace_s=0"], "rendezvous.etcd_grace_s"),
        (["comm.backend=gloo"], "comm.backend"),  # a test aid for one GPU; gloo already on CPU
        (["comm.backend=gloo", "cluster.device=cpu"], "comm.backend"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(overrides: list[str], key: str) -> None:
    """As a launch checks them: the ImageNet job's data and model rules too."""
    with pytest.raises(ConfigError) as err:
        validate_launch(composed(*overrides))
    assert f"{key}=" in str(err.value) and "Fix:" in str(err.value)


# key=value: why. Fix: fix.  (the value is its repr; a list's repr has spaces)
PROBLEM = re.compile(r"(?P<key>[a-z_.]+)=(?P<value>.+?): (?P<why>[^:]+?)\. Fix: (?P<fix>.+)\.")


def test_every_problem_is_reported_at_once_in_one_shape() -> None:
    """Declared bounds and hand-written checks alike print ``key=value: why. Fix: fix.``"""
    with pytest.raises(ConfigError) as err:
        validate(
            composed(
                "cluster.nodes=0",
                "rendezvous.lease_ttl_s=1",
                "optim.momentum=1",
                "optim.milestones_epochs=[60,30]",
                "health.gpu_memory_fraction=0",
                "data.crop_size=8",
            )
        )
    header, *lines = str(err.value).split("\n")
    assert header == "invalid configuration:"
    matches = [PROBLEM.fullmatch(line.removeprefix("  ")) for line in lines]
    assert all(matches), lines
    found = {m["key"]: m for m in matches if m}
    assert set(found) == {
        "cluster.nodes",
        "cluster.min_nodes",  # 1 is more than the 0 nodes a round may hold
        "rendezvous.lease_ttl_s",
        "optim.momentum",
        "optim.milestones_epochs",
        "health.gpu_memory_fraction",
        "data.crop_size",
    }
    # Custom reasons are kept; the others are made from the bound.
    assert found["cluster.nodes"]["why"] == "a job needs at least one node"
    assert found["rendezvous.lease_ttl_s"]["why"] == "etcd does not keep leases shorter than 2 s"
    assert found["optim.momentum"]["why"] == "must be in [0, 1)"
    assert found["health.gpu_memory_fraction"]["why"] == "must be in (0, 0.99]"
    assert found["optim.momentum"]["value"] == "1.0"
    assert found["optim.momentum"]["fix"] == "set optim.momentum=0.9"


@pytest.mark.parametrize(
    "override",
    [
        "rendezvous.lease_ttl_s=2",
        "rendezvous.settle_s=0",
        "optim.momentum=0",
        "optim.gamma=1",
        "optim.warmup_epochs=0",
        "health.gpu_memory_fraction=0.99",
        "health.quarantine_s=2",
        "cluster.max_nodes=0",
        "data.generate.classes=2",
        "data.crop_size=16",
    ],
)
def test_a_value_on_the_bound_passes(override: str) -> None:
    validate(composed(override))


def test_generate_bounds_are_checked_only_with_synthetic_data(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    validate(composed("data=imagenet", f"data.root={tmp_path}", "data.generate.classes=1"))
    with pytest.raises(ConfigError, match="data.generate.classes=1"):
        validate(composed("data.generate.classes=1"))


def test_schema_defaults_satisfy_their_bounds() -> None:
    validate(Config())


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"ge": 1}, "must be at least 1"),
        ({"ge": 0}, "must not be negative"),
        ({"gt": 0}, "must be positive"),
        ({"gt": 0.5}, "must be more than 0.5"),
        ({"le": 10}, "must be at most 10"),
        ({"lt": 1}, "must be less than 1"),
        ({"ge": 0, "lt": 1}, "must be in [0, 1)"),
        ({"gt": 0, "le": 0.99}, "must be in (0, 0.99]"),
        ({"ge": 2, "why": "etcd does not keep leases shorter than 2 s"}, "etcd does not keep"),
    ],
)
def test_a_bound_says_why_from_its_limits(kwargs: dict[str, object], why: str) -> None:
    bound = Bound(fix="set it", **kwargs)  # type: ignore[arg-type]
    assert bound.why.startswith(why)


@pytest.mark.parametrize(
    ("kwargs", "value", "holds"),
    [
        ({"ge": 2}, 2, True),
        ({"ge": 2}, 1.9, False),
        ({"gt": 0}, 0, False),
        ({"ge": 0, "lt": 1}, 0, True),
        ({"ge": 0, "lt": 1}, 1, False),
        ({"gt": 0, "le": 1}, 1, True),
    ],
)
def test_a_bound_holds_on_its_closed_ends_only(
    kwargs: dict[str, float], value: float, holds: bool
) -> None:
    assert Bound(fix="set it", **kwargs).holds(value) is holds  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"ge": 0, "gt": 0}, {"le": 1, "lt": 1}, {"ge": 0, "fix": ""}],
)
def test_a_bound_without_a_limit_or_a_fix_is_a_programming_error(
    kwargs: dict[str, object],
) -> None:
    with pytest.raises(TypeError):
        Bound(**{"fix": "set it", **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("override", "key", "allowed"),
    [
        ("cluster.mode=cloud", "cluster.mode", "[local, bare_metal]"),
        ("cluster.device=gpu", "cluster.device", "[auto, cpu, cuda]"),
        ("optim.policy=foo", "optim.policy", "[rescale_lr, keep_global_batch]"),
    ],
)
def test_a_spelling_outside_an_enum_is_refused_at_composition(
    override: str, key: str, allowed: str
) -> None:
    with pytest.raises(HydraException) as err:  # Hydra's error wraps OmegaConf's
        composed(override)
    assert key in str(err.value)
    assert allowed in str(err.value.__cause__)
    # The commands that compose through launcher.compose show OmegaConf's text: the full key and
    # the allowed values, not only Hydra's "Error merging override".
    with pytest.raises(UsageError) as usage:
        compose_launch([override])
    assert f"full_key: {key}" in str(usage.value) and allowed in str(usage.value)
    assert "Fix:" in str(usage.value)


def run_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "job_id=refused",
            f"run_dir={tmp_path / 'run'}",
            *overrides,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("cluster.min_nodes=9", "cluster.min_nodes=9"),  # a value that cannot work
        ("cluster.nodes=abc", "cluster.nodes"),  # a type error, caught by the schema
        ("cluster.nodez=3", "nodez"),  # an unknown key
        ("model=resnet9000", "model"),  # an unknown preset
        ("cluster.device=gpu", "expected one of [auto, cpu, cuda]"),  # outside an enum
        ("checkpoint.url=file:///etc/hostname/ckpt", "checkpoint.url="),  # a file as parent
    ],
)
def test_launcher_refuses_bad_config_before_anything_starts(
    tmp_path: Path, override: str, expected: str
) -> None:
    result = run_cli(tmp_path, override)
    assert result.returncode != 0
    assert expected in result.stderr
    assert not (tmp_path / "run").exists()  # no run directory, no etcd, no node started


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", *args], check=True, timeout=300, capture_output=True
    )


def test_configs_ship_in_the_wheel(tmp_path: Path) -> None:
    """Hydra finds conf/ through pkg://conf, so the YAML files must be package data."""
    pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO))
    wheel = next(tmp_path.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml")}
    assert shipped and shipped <= names
    # Installed without -e, from a folder that is not the checkout, composition still works.
    site = tmp_path / "site"
    pip("install", "--no-deps", "-q", "--target", str(site), str(wheel))
    probe = (
        "from hydra import compose, initialize_config_module; import launcher.cli, conf; "
        f"assert conf.__file__.startswith({str(site)!r}), conf.__file__; "
        "initialize_config_module(config_module='conf', version_base=None); "
        "print(compose('config', overrides=['model=resnet50']).model.name)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(site)},
    )
    assert result.stdout.strip() == "resnet50", result.stderr


def test_gloo_on_cuda_is_accepted_as_a_test_aid() -> None:
    for dtype in ("fp32", "bf16", "fp16"):
        validate(composed("cluster.device=cuda", "comm.backend=gloo", f"comm.grad_dtype={dtype}"))


def test_the_imagenet_jobs_data_and_model_rules_do_not_stop_another_job() -> None:
    imagenet = ["data=imagenet", "data.root=/nonexistent/imagenet", "model.name=resnet9000"]
    validate(composed(*imagenet))  # the rules every job shares
    with pytest.raises(ConfigError, match=r"(?s)data.root=.*model.name="):
        validate_launch(composed(*imagenet))
    validate_launch(composed(*imagenet, "job=lm"))


def test_sharding_is_refused_where_it_cannot_recover_or_reduce() -> None:
    """parallel.shard=node: not yet on CUDA over NCCL (that path has not run on a GPU; gloo on
    CUDA tensors, the test aid, is taken), not with fp16's scaler (it reads whole gradients), not
    with the DDP hook's wire dtype."""
    validate(composed("job=lm", "parallel.shard=node", "trainer.precision=bf16"))
    validate(composed("job=lm", "parallel.shard=node", "cluster.device=cuda", "comm.backend=gloo"))
    with pytest.raises(ConfigError) as refused:
        validate(
            composed(
                "parallel.shard=node",
                "cluster.device=cuda",
                "trainer.precision=fp16",
                "comm.grad_dtype=bf16",
            )
        )
    lines = str(refused.value).splitlines()[1:]
    assert [line.split("=")[0].strip() for line in lines] == [
        "parallel.shard",
        "trainer.precision",
        "comm.grad_dtype",
    ]
    assert all("Fix: " in line and "parallel.shard=none" in line for line in lines), lines


def test_decode_once_is_refused_where_the_split_would_take_over_half_the_memory() -> None:
    from elastic.config.training_rules import once_memory_problem

    gib = 2**30
    assert once_memory_problem(640, 224, 1 * gib) is None  # the GPU proof's: 96 MiB
    imagenet = once_memory_problem(1_281_167, 224, 256 * gib)  # 180 GiB
    assert imagenet is not None
    assert imagenet.startswith("data.decode='once': it holds the training split")
    assert "1,281,167 images x 3 x 224 x 224 bytes = 179.6 GiB" in imagenet
    assert "256.0 GiB available. Fix: use data.decode=host" in imagenet
    half = 640 * 3 * 224 * 224 * 2
    assert once_memory_problem(640, 224, half) is None
    assert once_memory_problem(640, 224, half - 1) is not None
    # Each worker of the machine holds a copy: 8 GPUs' workers need 8 times as much.
    assert once_memory_problem(640, 224, 8 * half, copies=8) is None
    eight = once_memory_problem(200_000, 224, 256 * gib, copies=8)
    assert eight is not None and once_memory_problem(200_000, 224, 256 * gib) is None
    assert "= 28.0 GiB, 224.3 GiB for the 8 workers on this machine, and that is more" in eight
    assert eight.endswith("or a smaller data.crop_size, or fewer workers on a machine.")


def test_the_workers_a_launch_counts_on_its_machine() -> None:
    from elastic.config.training_rules import workers_on_this_machine

    def count(*overrides: str) -> int:
        return workers_on_this_machine(composed(*overrides))

    assert count() == 2  # the local defaults: 2 nodes of one CPU worker
    assert count("cluster.nodes=3", "cluster.cpu_workers=2", "cluster.device=cpu") == 6
    assert count("cluster.nodes=3", "cluster.workers_per_node=4") == 12
    assert count("cluster.nodes=3", "cluster.device=cuda") == 3  # CUDA's count: the workers'
    bare = ("cluster.mode=bare_metal", "cluster.nodes=16", "cluster.workers_per_node=8")
    assert count(*bare) == 8


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        (
            ["chaos.fail_collectives_node=node1", "chaos.fail_collectives_step=5"],
            "chaos.fail_collectives_node='node1': makes a node's collectives fail on purpose",
        ),
        (
            ["chaos.allow=true", "chaos.fail_collectives_node=node1"],
            "chaos.fail_collectives_step=0: no such step: steps count from 1",
        ),
    ],
)
def test_the_failing_collectives_hook_needs_chaos_allow_and_a_step(
    overrides: list[str], refusal: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        validate(composed(*overrides))
    validate(composed("chaos.allow=true", *overrides, "chaos.fail_collectives_step=1"))


def test_decode_once_is_refused_at_launch_for_a_split_this_machine_cannot_hold(
    tmp_path: Path,
) -> None:
    """Counted before any worker starts: the generated split from its settings, a folder by its
    files; the fit one passes."""
    huge = ["data.generate.classes=1000", "data.generate.images_per_class=1000000"]
    with pytest.raises(ConfigError, match=re.escape("data.decode='once': it holds the training")):
        validate_launch(composed("data.decode=once", "data.crop_size=224", *huge))
    validate_launch(composed("data.decode=once"))
    validate_launch(composed("data.decode=host", "data.crop_size=224", *huge))  # not held
    for c in range(2):
        (tmp_path / "train" / f"c{c}").mkdir(parents=True)
        for i in range(3):
            (tmp_path / "train" / f"c{c}" / f"{i}.jpg").write_bytes(b"")
    folder = ("data=imagenet", f"data.root={tmp_path}", 'data.val_dir=""', "data.decode=once")
    validate_launch(composed(*folder))
