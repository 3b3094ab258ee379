"""One configuration: defaults < TOML < environment < command line, with named errors."""

import pytest

from logjam_relay import config
from logjam_relay.cli import run_parser
from logjam_relay.config import helptext
from logjam_relay.relay import configure


def parse(argv):
    return {k: v for k, v in vars(run_parser().parse_args(argv)).items() if k != "check_config"}


def test_defaults_are_logjam_devices():
    s = config.load({}, environ={})
    assert (s.router_port, s.pull_port, s.pub_port, s.stats_port, s.metrics_port) == \
        (9604, 9605, 9606, 9621, 8082)
    assert (s.rcv_hwm, s.snd_hwm, s.device_id, s.compress, s.compressors) == \
        (100_000, 1_000_000, 0, None, 4)
    assert s.bind == "*" and s.metrics_ip == "0.0.0.0"
    assert s.resolved_spool_dir() is None   # no output: the plain logjam-device drop-in


def test_logjam_device_flags():
    s = config.load(parse(["-d", "7", "-i", "2", "-p", "1", "-t", "2", "-P", "3", "-s", "4",
                           "-x", "snappy", "-C", "8", "-R", "10", "-S", "20", "-m", "5",
                           "-M", "127.0.0.1", "-A", "-q", "-vv", "-T", "60"]), environ={})
    assert (s.device_id, s.io_threads, s.pull_port, s.router_port, s.pub_port, s.stats_port) == \
        (7, 2, 1, 2, 3, 4)
    assert (s.compress, s.compressors, s.rcv_hwm, s.snd_hwm, s.metrics_port) == \
        ("snappy", 8, 10, 20, 5)
    assert s.metrics_ip == "127.0.0.1" and s.allow_invalid_meta and s.quiet and s.verbose == 2


def test_precedence_toml_env_flags(tmp_path):
    toml = tmp_path / "relay.toml"
    toml.write_text('device_id = 1\nrcv_hwm = 5\n[spool]\nmax_bytes = "1MiB"\n'
                    'policy = "drop_oldest"\n')
    env = {"LOGJAM_RELAY_DEVICE_ID": "2", "LOGJAM_RCV_HWM": "6",
           "LOGJAM_RELAY_CONFIG": str(toml)}
    s = config.load(parse(["-d", "3"]), environ=env)
    assert s.device_id == 3 and s.sources["device_id"] == "--device-id"
    assert s.rcv_hwm == 6 and s.sources["rcv_hwm"] == "LOGJAM_RCV_HWM"
    assert s.spool_max_bytes == 1024 * 1024 and s.spool_policy == "drop_oldest"
    assert s.sources["spool_policy"] == str(toml)


@pytest.mark.parametrize("args,env,toml,message", [
    (["-x", "gzip"], {}, None, "compress (--compress): must be one of zlib, snappy, lz4"),
    (["-p", "70000"], {}, None, "pull_port (--pull-port): must be <= 65535"),
    ([], {"LOGJAM_RELAY_SPOOL_POLICY": "keep"}, None,
     "spool_policy (LOGJAM_RELAY_SPOOL_POLICY): must be one of block, drop_oldest, got 'keep'"),
    ([], {"LOGJAM_SND_HWM": "lots"}, None, "snd_hwm (LOGJAM_SND_HWM): expected an integer"),
    ([], {}, "spool_max_bytes = 'huge'\n", "spool_max_bytes (relay.toml): expected a size"),
    ([], {}, "no_such = 1\n", "no_such (relay.toml): unknown setting"),
    ([], {}, "device_id = \n", "relay.toml"),
    (["-t", "9605"], {}, None, "port 9605 is already used by pull_port"),
    (["--output", "lumberjack://h:5044?window=x"], {}, None,
     "outputs (--output): lumberjack URL: parameter 'window'"),
    (["--output", "http://h"], {}, None, "unknown scheme 'http'"),
    (["--archive-seal-after", "soon"], {}, None, "archive_seal_after (--archive-seal-after)"),
    (["--samwise", "tcp://*:9610"], {}, None, "samwise/amqp_brokers"),
])
def test_errors_name_the_setting(tmp_path, args, env, toml, message):
    if toml is not None:
        (tmp_path / "relay.toml").write_text(toml)
        args = ["--config", str(tmp_path / "relay.toml"), *args]
        message = message.replace("relay.toml", str(tmp_path / "relay.toml"))
    with pytest.raises(config.ConfigError) as ei:
        configure.load(parse(args), environ=env)    # with the subsystems' checks
    assert message in str(ei.value)


def test_sizes_and_durations():
    assert config.size("64MiB") == 64 * 1024**2 and config.size("10GB") == 10 * 1000**3
    assert config.size(512) == 512
    assert config.duration("250ms") == 0.25 and config.duration("7d") == 7 * 86400
    assert config.duration(2) == 2.0


def test_output_implies_spool_dir(tmp_path):
    s = config.load(parse(["--output", "lumberjack://h:5044?tls=off",
                           "--state-dir", str(tmp_path)]), environ={})
    assert s.resolved_spool_dir() == tmp_path / "spool"


@pytest.mark.parametrize("env,message", [
    ({"LOGJAM_RELAY_SPOOL_MAX_BYTE": "1GiB"},
     "LOGJAM_RELAY_SPOOL_MAX_BYTE (environment): unknown setting (did you mean "
     "LOGJAM_RELAY_SPOOL_MAX_BYTES?)"),
    ({"LOGJAM_RELAY_DEVICEID": "3"}, "(did you mean LOGJAM_RELAY_DEVICE_ID?)"),
    ({"LOGJAM_RELAY_XYZZY": "1"}, "LOGJAM_RELAY_XYZZY (environment): unknown setting"),
])
def test_unknown_environment_variables_stop_start_up(env, message):
    with pytest.raises(config.ConfigError) as ei:
        config.load({}, environ=env)
    assert message in str(ei.value)
    if "XYZZY" in message:
        assert "did you mean" not in str(ei.value)


def test_environment_names_that_are_not_settings_are_allowed(tmp_path):
    (tmp_path / "r.toml").write_text("device_id = 4\n")
    s = config.load({}, environ={"LOGJAM_RELAY_CONFIG": str(tmp_path / "r.toml"),
                                 "LOGJAM_RELAY_PURE_PYTHON": "1", "LOGJAM_OTHER": "x",
                                 "LOGJAM_RELAY_NATIVE_INFLATE": "0",
                                 "LOGJAM_RELAY_SYNC_THREAD": "0",
                                 "LOGJAM_RELAY_TEST_CACHE": "/tmp"})
    assert s.device_id == 4


def test_unknown_toml_key_suggests_the_setting(tmp_path):
    (tmp_path / "r.toml").write_text("[spool]\nmax_byte = 1\n")
    with pytest.raises(config.ConfigError) as ei:
        config.load({}, environ={}, config_file=tmp_path / "r.toml")
    assert "spool_max_byte" in str(ei.value) and "did you mean spool_max_bytes?" in str(ei.value)


def test_source_labels_and_startup_error_line(tmp_path):
    (tmp_path / "r.toml").write_text("pub_port = 7\n")
    s = config.load(parse(["-p", "5"]), environ={"LOGJAM_RELAY_STATS_PORT": "6"},
                    config_file=tmp_path / "r.toml")
    assert s.source_label("router_port") == "default"
    assert s.source_label("pull_port") == "flag --pull-port"
    assert s.source_label("stats_port") == "env LOGJAM_RELAY_STATS_PORT"
    assert s.source_label("pub_port") == f"file {tmp_path / 'r.toml'}"
    e = s.startup_error("router_port", "address already in use")
    assert str(e) == "router_port 9604 (default): address already in use"
    assert str(s.startup_error("state_dir", "x")).startswith(f"state_dir {s.resolved_state_dir()}")


def test_display_values_use_human_units():
    assert helptext.display_value("spool_max_bytes", 10 * 1024**3) == "10 GiB"
    assert helptext.display_value("spool_segment_bytes", 64 * 1024**2) == "64 MiB"
    assert helptext.display_value("spool_fsync_interval", 0.25) == "250 ms"
    assert helptext.display_value("heartbeat_interval", 5.0) == "5 s"
    assert helptext.display_value("archive_retention", 7 * 86400.0) == "7 d"
    assert helptext.display_value("archive_seal_after", 300.0) == "5 min"
    assert helptext.display_value("compress", None) == "off"
    assert helptext.display_value("outputs", []) == "none"
    s = config.load({}, environ={})
    shown = {n: v for n, v, _ in helptext.effective_values(s)}
    assert shown["state_dir"] == f"{s.resolved_state_dir()} (resolved)"
    assert shown["fqdn"] == f"{config.default_fqdn()} (resolved)"
    assert "None" not in " ".join(shown.values())
