"""`jaxseek generate` and `jaxseek serve` take vLLM's flag names; today's names stay aliases of the same settings."""

import pytest

from jaxseek.cli import BENCHMARKS, build_parser, main, unused_by_a_prefill_server
from jaxseek.flags import byte_size, engine_config, package_version

VLLM = ["--max-model-len", "256", "--max-num-seqs", "4", "--no-enable-prefix-caching", "--chat-template", "plain",
        "--max-num-batched-tokens", "40", "--num-gpu-blocks-override", "96", "--seed", "5", "--log-level", "WARNING"]
TODAY = ["--max-len", "256", "--max-slots", "4", "--no-prefix-cache", "--chat-format", "plain",
         "--token-budget", "40", "--num-kv-pages", "96", "--seed", "5", "--log-level", "warning"]


def settings(argv):
    args = build_parser().parse_args(argv)
    return {k: v for k, v in vars(args).items() if k not in ("fn", "parser")}, args


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_vllm_names_and_todays_aliases_parse_to_the_same_settings(command):
    vllm, args = settings(command + VLLM)
    assert vllm == settings(command + TODAY)[0]
    assert (args.max_len, args.max_slots, args.chat_format, args.seed, args.log_level) == (256, 4, "plain", 5,
                                                                                          "warning")
    engine = engine_config(args)
    assert (engine.prefix_cache, engine.token_budget, engine.num_pages, engine.max_len) == (False, 40, 96, 256)


@pytest.mark.parametrize("flag, expected", [([], None), (["--enable-prefix-caching"], True),
                                            (["--no-enable-prefix-caching"], False)])
def test_prefix_caching_default_on_and_off(flag, expected):
    _, args = settings(["serve", *flag])
    assert engine_config(args).prefix_cache is expected  # None: on unless --batch-invariant


def test_kv_cache_memory_is_a_size_and_excludes_a_page_count():
    assert [byte_size(t) for t in ("1024", "512M", "1.5GiB", "2k")] == [1024, 512 << 20, 3 << 29, 2048]
    _, args = settings(["serve", "--kv-cache-memory", "8GiB"])
    assert args.kv_cache_memory == 8 << 30 and engine_config(args).kv_cache_memory == 8 << 30
    _, args = settings(["serve", "--kv-cache-memory", "8GiB", "--num-kv-pages", "64"])
    with pytest.raises(ValueError, match="kv_cache_memory or num_pages, not both"):
        engine_config(args)


def test_a_prefill_server_names_the_engine_flags_it_does_not_use():
    _, args = settings(["serve", "--role", "prefill", "--mesh", "dp=2", "--seed", "3"])
    assert unused_by_a_prefill_server(args) == []
    _, args = settings(["serve", "--role", "prefill", "--mesh", "dp=2", "--max-num-seqs", "64", "--max-model-len",
                        "4096"])
    assert unused_by_a_prefill_server(args) == ["max_slots", "max_len"]


def engine_options(command: list[str]) -> dict[str, str]:
    """The options of a command's "engine" group with their help, as `--help` lists them."""
    parser = build_parser()._subparsers._group_actions[0].choices[command[0]]
    group = next(g for g in parser._action_groups if g.title == "engine")
    return {name: action.help for action in group._group_actions for name in action.option_strings}


def test_generate_and_serve_list_the_engine_flags_of_one_declaration():
    import dataclasses

    from serving.base.engine_config import EngineConfig

    declared = {name for field in dataclasses.fields(EngineConfig) for flag in field.metadata.get("flags", ())
                for name in flag.names}
    generate, serve = engine_options(["generate"]), engine_options(["serve"])
    for own in ("--warmup", "--no-warmup", "--compile-cache"):  # each command's own
        generate.pop(own), serve.pop(own, None)
    assert generate == serve and declared <= generate.keys()
    negated = {"--no-enable-prefix-caching", "--no-prefix-cache", "--no-host-layout", "--no-layer-programs"}
    assert generate.keys() - declared == negated  # the toggles' other halves


@pytest.mark.parametrize("argv, expected", [
    ([], {"zero_overhead": True, "layer_programs": None, "host_layout": None, "replay": None, "speculation": "none"}),
    (["--no-zero-overhead", "--no-layer-programs", "--host-layout", "--replay", "mask", "--speculation", "dspark"],
     {"zero_overhead": False, "layer_programs": False, "host_layout": True, "replay": ("mask", 140),
      "speculation": "dspark"}),
    (["--replay-keep", "200"], {"replay": ("compact", 200)}),
    (["--mesh", "dp=2,ep=2", "--eplb-every", "5", "--eplb-window", "20"],
     {"mesh": "dp=2,ep=2", "eplb_every": 5, "eplb_window": 20}),
])
def test_flags_become_the_declared_settings(argv, expected):
    from serving.base.engine_config import EngineConfig

    for command in (["generate", "--prompt", "x"], ["serve"]):
        config = engine_config(settings(command + argv)[1])
        got = {k: getattr(config, k) for k in expected}
        if "replay" in got:  # unset: the engine's default
            replay = got["replay"]
            got["replay"] = None if replay is EngineConfig.replay else (replay.mode, replay.keep)
        assert got == expected


def test_host_layout_applies_on_one_cpu_device_by_default():
    from serving.base.engine_config import EngineConfig

    assert EngineConfig().uses_host_layout and not EngineConfig(host_layout=False).uses_host_layout
    assert not EngineConfig(mesh="dp=2").uses_host_layout  # a mesh places the checkpoint layout


def test_settings_that_do_not_go_together_exit_2_naming_them(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--eplb-every", "5"])
    assert e.value.code == 2 and "EPLB (redundant_experts, eplb_every) needs a mesh" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["serve", "--kv-cache-memory", "lots"], "expected a size such as"),
    (["serve", "--chat-template", "no/such/template.jinja"], "is neither a chat format"),
    (["generate", "--prompt", "x", "--max-num-seqs", "0"], "--max-num-seqs/--max-slots: must be >= 1"),
    (["serve", "--dtype", "float16"], "invalid choice: 'float16'"),
    (["serve", "--log-level", "loud"], "invalid choice: 'loud'"),
])
def test_bad_values_exit_2_with_the_flag_named(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"], ["generate", "--version"]])
def test_version(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"jaxseek {package_version()}"


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_dtype_is_the_resident_weights_flag(command):
    assert settings(command + ["--dtype", "bfloat16"])[0] == settings(command + ["--weights", "bfloat16"])[0]
    assert settings(command)[1].weights == "auto"  # the checkpoint's default format (model.checkpoint.default_weights)


def test_chat_template_file_renders_messages(tmp_path):
    from serving.api.chat_format import format_for
    from serving.base.tokenizer import ByteTokenizer

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    _, args = settings(["serve", "--chat-template", str(template)])
    fmt = format_for(ByteTokenizer(256), args.chat_format)
    assert fmt.render([{"role": "user", "content": "Hi"}]) == "<user>Hi<assistant>"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_reaches_each_benchmark(name, capsys):
    """`jaxseek bench NAME ARGS` hands ARGS to the benchmark's own parser (here --help: nothing runs)."""
    import importlib

    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    doc = importlib.import_module(BENCHMARKS[name]).__doc__.split("\n")[0]
    assert e.value.code == 0 and doc.split(":")[0][:30] in " ".join(capsys.readouterr().out.split())
