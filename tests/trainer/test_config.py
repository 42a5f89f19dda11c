"""Flag parsing and validation: needs no MPI."""

import pytest

from mpiddp.trainer.config import Config, ConfigError, FaultInjection, HelpRequested, parse_args


def test_defaults_parse_to_the_documented_job():
    cfg = parse_args([])
    assert cfg == Config()
    assert cfg.dist.device == "auto" and cfg.dist.backend == "auto"
    assert cfg.training.epochs >= 1 and cfg.training.batch_size >= 1


def test_flags_reach_the_config():
    cfg = parse_args(["--epochs", "3", "--batch-size", "8", "--lr", "0.1", "--run-dir", "/tmp/x", "--device", "cpu"])
    assert (cfg.training.epochs, cfg.training.batch_size, cfg.training.lr, cfg.outputs.run_dir, cfg.dist.device) == (3, 8, 0.1, "/tmp/x", "cpu")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--batch-size", "-2"], "--batch-size must be at least 1"),
        (["--lr", "0"], "--lr must be in (0, 10]"),
        (["--lr", "50"], "--lr must be in (0, 10]"),
        (["--momentum", "1.5"], "--momentum"),
        (["--device", "tpu"], "--device must be one of auto, cpu, cuda"),
        (["--backend", "ucc"], "--backend must be one of"),
        (["--device", "cpu", "--backend", "nccl"], "--backend nccl needs GPUs"),
        (["--master-addr", " "], "--master-addr is empty"),
        (["--epochs", "two"], "invalid int value"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["--inject-fault", "explode:1:2"], "--inject-fault must be KIND:RANK:STEP"),
    ],
)
def test_bad_flags_raise_one_clear_config_error(argv, fragment):
    with pytest.raises(ConfigError) as caught:
        parse_args(argv)
    assert fragment in str(caught.value)
    assert "\n" not in str(caught.value)


def test_help_is_raised_not_printed(capsys):
    with pytest.raises(HelpRequested) as caught:
        parse_args(["--help"])
    assert "--batch-size" in caught.value.text
    assert capsys.readouterr().out == ""


def test_master_addr_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MPIDDP_MASTER_ADDR", "10.1.2.3")
    assert parse_args([]).dist.master_addr == "10.1.2.3"
    assert parse_args(["--master-addr", "nodea"]).dist.master_addr == "nodea"


def test_fault_spec_parses():
    assert FaultInjection.parse("raise:1:3") == FaultInjection("raise", 1, 3)
    with pytest.raises(ValueError):
        FaultInjection.parse("raise:x:3")


def test_config_is_json_ready():
    import json

    cfg = parse_args(["--inject-fault", "exit0:0:1"])
    assert json.loads(json.dumps(cfg.to_dict()))["inject_fault"] == {"kind": "exit0", "rank": 0, "step": 1}


def test_every_setting_has_exactly_one_flag_with_help_and_its_default():
    from mpiddp.job.flags import flag_fields
    from mpiddp.trainer.config import build_parser

    text = build_parser().format_help()
    for spec, _ in flag_fields(Config):
        if spec.name == "inject_fault":
            continue  # for tests; documented in the README only
        assert spec.metadata["names"][0] in text, spec.name
        assert spec.metadata["help"], spec.name


def test_shortcuts_and_classic_aliases():
    cfg = parse_args(["--use_syn", "--no-progress", "--num_epochs", "2", "--local_rank", "3", "--wandb-tags", "a, b,"])
    assert (cfg.data.dataset, cfg.outputs.progress, cfg.training.epochs, cfg.outputs.wandb_tags) == ("synthetic", "off", 2, ("a", "b"))
    assert parse_args(["--resume"]).checkpoint.resume == "auto"


def test_rules_hold_however_the_config_is_built():
    with pytest.raises(ValueError, match="--keep-last must be at least 1"):
        Config.of(keep_last=0)
    with pytest.raises(ValueError, match="--amp must be one of off, bf16, fp16"):
        Config.of(amp="fp8")


def test_wandb_mode_lives_with_the_flag_so_check_never_reaches_into_the_trainer(tmp_path):
    import ast
    from pathlib import Path

    from mpiddp.trainer.config import wandb_mode

    netrc = tmp_path / "netrc"
    assert wandb_mode("auto", {}, netrc) == "offline"
    netrc.write_text("machine api.wandb.ai login user password key\n")
    assert wandb_mode("auto", {}, netrc) == "online" and wandb_mode("auto", {"WANDB_MODE": "disabled"}, netrc) == "disabled"
    assert wandb_mode("offline", {"WANDB_API_KEY": "k"}, netrc) == "offline"
    check = ast.parse((Path(__file__).resolve().parents[2] / "mpiddp" / "tools" / "check.py").read_text())
    imported = {node.module for node in ast.walk(check) if isinstance(node, ast.ImportFrom)}
    assert "mpiddp.trainer.metrics" not in imported  # a tool, not the trainer's metric log


def test_the_config_is_in_sections_and_each_flag_is_declared_once():
    import dataclasses

    from mpiddp.job.flags import DistSettings, flag_fields

    cfg = parse_args(["--dataset", "synthetic", "--lr", "0.2", "--keep-last", "2", "--wandb", "disabled",
                      "--device", "cpu", "--inject-fault", "raise:0:1"])
    assert (cfg.data.dataset, cfg.training.lr, cfg.checkpoint.keep_last, cfg.outputs.wandb, cfg.dist.device) == \
        ("synthetic", 0.2, 2, "disabled", "cpu")
    assert cfg.drills.inject_fault == FaultInjection("raise", 0, 1)
    assert isinstance(cfg.dist, DistSettings)
    names = [spec.name for spec, _ in flag_fields(Config)]
    assert len(names) == len(set(names)) == sum(len(dataclasses.fields(type(section))) for section in
                                                (cfg.data, cfg.training, cfg.checkpoint, cfg.outputs, cfg.dist, cfg.drills))
    assert list(cfg.to_dict()) == names  # the flat view of logs, summaries and snapshots, as before the sections
    assert Config.of(lr=0.2, device="cpu") == Config().replace(lr=0.2, device="cpu")
    with pytest.raises(TypeError, match="no setting nonsense"):
        Config.of(nonsense=1)


def test_the_network_settings_are_declared_once_for_training_run_and_init():
    import inspect

    from mpiddp.job import bootstrap
    from mpiddp.script import api
    from mpiddp.job.flags import DistSettings, flag_fields
    from mpiddp.script.run import RunConfig

    declared = {spec.name: spec for spec, _ in flag_fields(DistSettings)}
    training = {spec.name: spec for spec, _ in flag_fields(Config)}
    run = {spec.name: (spec, meta) for spec, meta in flag_fields(RunConfig)}
    for name in ("master_addr", "iface", "rendezvous_timeout_s", "num_threads"):
        assert training[name] is declared[name] and run[name][0] is declared[name]  # the same field, not a copy
    assert run["master_addr"][1]["help"] != declared["master_addr"].metadata["help"]  # run's own wording
    assert isinstance(api.InitSettings().dist, DistSettings)
    for wrong in (-1.0, float("nan")):  # init's hang_timeout_s: NaN would turn the watchdog off unsaid
        with pytest.raises(ValueError, match="hang_timeout_s must be 0 \\(off\\) or positive"):
            api.InitSettings(hang_timeout_s=wrong)
    assert not [name for name, value in vars(bootstrap).items()
                if inspect.isclass(value) and value.__module__ == bootstrap.__name__ and name.endswith("Settings")]
