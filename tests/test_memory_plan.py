"""The memory plan (agentopd.memory_plan): its arithmetic against hand-computed numbers for a Qwen3-0.6B
shape, the refusal of a run that cannot fit (fake GPU sizes), `agentopd plan-memory`, and the one-line
error of a CUDA out-of-memory in a run (simulated on CPU), with its checkpoint."""

import json
import re
import time

import pytest
import torch

from agentopd.config import load_config
from agentopd.memory_plan import (
    GIB,
    MemoryPlanError,
    ModelShape,
    OutOfMemory,
    Phase,
    PhaseMemory,
    measure_since_last,
    plan_memory,
)

QWEN3 = {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}
Q06 = {**QWEN3, "num_hidden_layers": 28, "hidden_size": 1024, "intermediate_size": 3072, "tie_word_embeddings": True}
Q17 = {**QWEN3, "num_hidden_layers": 28, "hidden_size": 2048, "intermediate_size": 6144, "tie_word_embeddings": True}
Q8 = {**QWEN3, "num_attention_heads": 32, "num_hidden_layers": 36, "hidden_size": 4096, "intermediate_size": 12288,
      "tie_word_embeddings": False}  # fmt: skip
Q32 = {**QWEN3, "num_attention_heads": 64, "num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 25600,
       "tie_word_embeddings": False}  # fmt: skip


def _item(plan, what):
    (item,) = [i for i in plan.items if i.what.startswith(what)]
    return item


def test_qwen3_0_6b_shape_by_hand():
    s = ModelShape.from_hf_config(Q06)
    # a layer: q 1024x2048, k and v 1024x1024, o 2048x1024, q/k norms 2x128, MLP 3x1024x3072, two norms 2x1024
    layer = 2 * 1024 * 2048 + 2 * 1024 * 1024 + 256 + 3 * 1024 * 3072 + 2048
    assert layer == 15_730_944
    assert s.params == 28 * layer + 1024 + 151936 * 1024 == 596_049_920  # tied: the embedding once
    assert s.kv_bytes_per_token() == 112 * 1024  # 2 x 28 layers x 1,024 x 2 bytes (NOTES: 112 KiB a token)
    # a = 12H + 6q + 6kv + 8I with the fp32 residual of one process
    assert s.layer_activation_bytes(4) == 12 * 1024 + 6 * 2048 + 6 * 1024 + 8 * 3072 == 55_296


def test_plan_arithmetic_for_a_qwen3_0_6b_student_on_one_gpu():
    cfg = load_config("sql_db", overrides=["trainer.micro_batch_tokens=8192", "trainer.chunk_size=1024",
                                           "trainer.loss=reverse_kl", "eval.teacher=false", "engine.sleep=false"])  # fmt: skip
    s = ModelShape.from_hf_config(Q06)
    plan = plan_memory(cfg, {"student": s, "teacher": s}, [80.0])
    P = 596_049_920
    assert _item(plan, "fp32 master").gib == pytest.approx(4 * P / GIB)  # 2.22 GiB
    assert _item(plan, "AdamW").gib == pytest.approx(8 * P / GIB)
    assert _item(plan, "fp32 gradients").phases == (Phase.TRAIN,)
    # no checkpointing: 8,192 tokens x 28 layers x 55,296 B + the final hidden rows 8,192 x 1,024 x (4 + 4)
    assert _item(plan, "activations").gib == pytest.approx((8192 * 28 * 55296 + 8192 * 1024 * 8) / GIB)  # 11.87 GiB
    # two 1,024 x V bf16 logit buffers, the fp32 head gradient, the hidden gradient
    assert _item(plan, "loss buffers").gib == pytest.approx((4 * 1024 * 151936 + 4 * 151936 * 1024 + 2 * 8192 * 1024) / GIB)
    assert _item(plan, "KV pool").gib == 16.0  # the fast engine's default
    assert plan.fits and not plan.engine_sleep
    train = plan.peak(0, Phase.TRAIN)
    assert train == pytest.approx(sum(i.gib for i in plan.items if Phase.TRAIN in i.phases))

    ckpt = load_config("sql_db", overrides=["trainer.micro_batch_tokens=8192", "trainer.activation_checkpointing=true",
                                            "trainer.checkpoint_every=2"])  # fmt: skip
    act = _item(plan_memory(ckpt, {"student": s, "teacher": s}, [80.0]), "activations").gib
    # 14 layers keep their fp32 input, 14 keep everything, one is recomputed in backward
    assert act == pytest.approx(8192 * (14 * 4 * 1024 + 14 * 55296 + 55296 + 1024 * 8) / GIB)


def test_an_8b_student_and_a_32b_teacher_are_refused_on_one_80gib_gpu_in_well_under_a_second():
    cfg = load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml")
    shapes = {"student": ModelShape.from_hf_config(Q8), "teacher": ModelShape.from_hf_config(Q32)}
    t0 = time.perf_counter()
    plan = plan_memory(cfg, shapes, [80.0])
    with pytest.raises(MemoryPlanError) as err:
        plan.check()
    assert time.perf_counter() - t0 < 0.5
    first, *table = str(err.value).splitlines()
    assert first.startswith("this run does not fit its GPUs: GPU 0 needs")
    assert "trainer.micro_batch_tokens" in first and "engine.kv_cache_gib" in first
    assert any("DOES NOT FIT" in line for line in table)
    assert plan.engine_sleep  # auto tried sleeping the engine first
    # what the run already has is not offered as a change (the example checkpoints activations; auto slept the
    # engine and offloaded the teacher)
    assert plan.teacher_offload
    for done in ("engine.sleep=true", "teacher.offload=true", "trainer.activation_checkpointing=true"):
        assert done not in first
    assert "eval.teacher=false" in first and "trainer.cpu_offload=true" in first
    on_ray = load_config("sql_db", config_file="configs/examples/qwen3-2gpu.yaml", overrides=["ray.engine_sleep=false"])
    with pytest.raises(MemoryPlanError, match=r"ray\.engine_sleep=true") as err:  # the Ray backend's name for it
        plan_memory(on_ray, shapes, [80.0, 80.0]).check()
    assert "engine.sleep=true," not in str(err.value).splitlines()[0].replace("ray.engine_sleep", "")
    assert isinstance(err.value, ValueError)  # the CLI's one-line error, exit code 2


def test_qwen3_gpu_example_with_1_7b_and_8b_shapes_fits_one_and_two_gpus():
    shapes = {"student": ModelShape.from_hf_config(Q17), "teacher": ModelShape.from_hf_config(Q8)}
    one = plan_memory(load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml"), shapes, [79.2])
    assert one.fits
    two = plan_memory(load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml", overrides=[
        "backend=ray", "ray.gpus_per_trainer_worker=1", "ray.rollout_workers=1", "ray.gpus_per_rollout_worker=0.5",
        "ray.gpus_per_teacher=0.5"]), shapes, [79.2, 79.2])  # fmt: skip
    assert two.fits
    assert {i.role for i in two.items if i.gpu == 0} == {"trainer", "cuda", "selftest"}  # the driver's pre-flight scorer
    assert {"engine", "teacher"} <= {i.role for i in two.items if i.gpu == 1}
    # the teacher's eval engine (31 GiB for 8B) is closed after the step-0 eval on Ray too: only the eval phase holds it
    eval_engine = [i for i in two.items if i.role == "eval"]  # its weights and its pool
    assert len(eval_engine) == 2 and all(i.gpu == 1 and tuple(i.phases) == (Phase.EVAL,) for i in eval_engine)
    assert two.peak(1, Phase.TEACHER) < two.peak(1, Phase.EVAL) - 25


def test_the_selftests_student_scorer_is_counted_in_the_teacher_phase_alone():
    """teacher.selftest's pre-flight loads the student a second time in the driver's process (agentopd.step.selftest),
    after the teacher scored its probe, and drops it: the plan counts its bf16 weights (and its scoring work beyond the
    teacher's) on the run's device in the teacher phase, nowhere else, and not where the self-test is off."""
    shapes = {"student": ModelShape.from_hf_config(Q17), "teacher": ModelShape.from_hf_config(Q8)}
    keys = ["engine.sleep=false", "teacher.offload=false", "engine.kv_cache_gib=8"]
    on = plan_memory(load_config("sql_db", overrides=keys), shapes, [200.0])
    off = plan_memory(load_config("sql_db", overrides=[*keys, "teacher.selftest=false"]), shapes, [200.0])
    scorer = _item(on, "student scorer")
    assert scorer.gpu == 0 and scorer.phases == (Phase.TEACHER,) and not [i for i in off.items if i.role == "selftest"]
    assert scorer.gib == pytest.approx(2 * shapes["student"].params / GIB)  # a 1.7B student works less than its 8B teacher
    assert on.peak(0, Phase.TEACHER) - off.peak(0, Phase.TEACHER) == pytest.approx(scorer.gib)
    assert all(on.peak(0, p) == off.peak(0, p) for p in Phase if p != Phase.TEACHER)
    # a teacher behind a server holds nothing here: the scorer's whole work counts
    alone = _item(plan_memory(load_config("sql_db", overrides=keys), {"student": shapes["student"]}, [200.0]), "student scorer")
    assert alone.gib > scorer.gib
    # on Ray the driver's scorer is on GPU 0, beside the trainer rank, not on the teacher's GPU
    ray = plan_memory(load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml", overrides=[
        "backend=ray", "ray.gpus_per_trainer_worker=1", "ray.rollout_workers=1", "ray.gpus_per_rollout_worker=0.5",
        "ray.gpus_per_teacher=0.5"]), shapes, [79.2, 79.2])  # fmt: skip
    assert _item(ray, "student scorer").gpu == 0 and _item(ray, "student scorer").gib > scorer.gib  # the teacher works on GPU 1


def test_eight_gpus_pair_an_engine_with_a_teacher_replica_on_each_gpu_after_the_trainer_ranks():
    """benchmarks/scale_gpu.py's 8gpu layout at the issue's shapes (1.7B student under FSDP2 on 4 GPUs, 8B teacher):
    the plan places actors as Ray does (agentopd.backends.placement.gpu_index), one engine and one teacher replica on
    each of GPUs 4-7 (not two engines on GPU 4 and two teachers on GPU 6), and it fits 80 GiB cards."""
    shapes = {"student": ModelShape.from_hf_config(Q17), "teacher": ModelShape.from_hf_config(Q8)}
    cfg = load_config("sql_db", config_file="configs/examples/qwen3-2gpu.yaml", overrides=[
        "ray.trainer_workers=4", "ray.gpus_per_trainer_worker=1", "ray.rollout_workers=4", "ray.gpus_per_rollout_worker=0.5",
        "ray.teacher_replicas=4", "ray.gpus_per_teacher=0.5"])  # fmt: skip
    plan = plan_memory(cfg, shapes, [79.2] * 8)
    assert plan.fits, plan.table()
    for g in range(8):
        roles = sorted({i.role for i in plan.items if i.gpu == g} - {"cuda", "eval"})
        assert roles == (["selftest", "trainer"] if g == 0 else ["trainer"] if g < 4 else ["engine", "teacher"]), (g, roles)
        weights = [i.what for i in plan.items if i.gpu == g and i.role in ("engine", "teacher") and "weights" in i.what]
        assert g < 4 or weights == ["student bf16 weights x1", "bf16 weights (8.19B) x1"], weights


def test_trainer_cpu_offload_moves_the_trainers_fp32_state_to_the_host_in_the_plan():
    """trainer.cpu_offload (FSDP2's CPUOffloadPolicy, Ray trainer ranks): the plan no longer puts the master weights,
    AdamW state and gradients on the trainer's GPU (a run that fits only offloaded was refused before), names the
    host memory they take, and keeps on the GPU the root unit and two layers in flight, by hand for 1.7B; on the
    local backend the key is refused at once (the trainer needs a process group to offload)."""
    shapes = {"student": ModelShape.from_hf_config(Q8), "teacher": ModelShape.from_hf_config(Q32)}
    keys = ["backend=ray", "ray.gpus_per_trainer_worker=1", "ray.rollout_workers=1", "ray.gpus_per_rollout_worker=1",
            "ray.gpus_per_teacher=1", "teacher.offload=false", "eval.teacher=false"]  # fmt: skip
    cfg = load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml", overrides=keys)
    resident = plan_memory(cfg, shapes, [79.2, 79.2, 79.2])
    offloaded = plan_memory(load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml", overrides=[*keys, "trainer.cpu_offload=true"]),
                            shapes, [79.2, 79.2, 79.2])  # fmt: skip
    assert not resident.fits  # an 8B student's fp32 state (131 GiB) alone does not fit one H100
    assert offloaded.fits, offloaded.table()
    P = shapes["student"].params
    assert abs(resident.peak(0, Phase.TRAIN) - offloaded.peak(0, Phase.TRAIN)
               - (16 * P + 2 * P) / GIB + (6 * 151936 * 4096 * 2 + 12 * (P - 151936 * 4096 * 2) / 36) / GIB) < 0.01  # fmt: skip
    assert any(f"pinned host memory, {16 * P / GIB:.1f} GiB a trainer rank" in n for n in offloaded.notes)
    assert not [i for i in offloaded.items if i.what.startswith(("fp32 master", "AdamW"))]
    with pytest.raises(ValueError, match="trainer.cpu_offload=true on run.backend=local"):
        load_config("sql_db", overrides=["trainer.cpu_offload=true"])


def test_kv_cache_keys():
    s = ModelShape.from_hf_config(Q06)
    cfg = load_config("sql_db", overrides=["engine.kv_cache_gib=4"])
    assert plan_memory(cfg, {"student": s}, [80.0]).kv_cache_gib == 4.0
    cfg = load_config("sql_db", overrides=["engine.kv_cache_fraction=0.5", "engine.sleep=false", "eval.teacher=false"])
    plan = plan_memory(cfg, {"student": s}, [80.0])
    rest = max(plan.peak(0, p) for p in Phase) - plan.kv_cache_gib
    assert plan.kv_cache_gib == pytest.approx(0.5 * (0.95 * 80 - rest))
    with pytest.raises(ValueError, match="both set"):
        load_config("sql_db", overrides=["engine.kv_cache_gib=4", "engine.kv_cache_fraction=0.5"])


def _model_dir(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return path


def test_plan_memory_command(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agentopd.cli import app

    s, t = _model_dir(tmp_path / "s", Q17), _model_dir(tmp_path / "t", Q8)
    cli = CliRunner()
    args = ["plan-memory", "--env", "sql_db", "--config", "configs/examples/qwen3-gpu.yaml", f"student={s}", f"teacher={t}"]
    result = cli.invoke(app, [*args, "--gpus", "1", "--gpu-gib", "80"])
    assert result.exit_code == 0, result.output
    assert "KV pool" in result.output and "fits" in result.output and "DOES NOT FIT" not in result.output
    # --gpus plans for another machine: its disk line says what the checkpoints take, judging no disk here
    assert "disk: 61.2 GiB at the peak (3 of 10 checkpoint(s) of 20.4 GiB, run.keep_checkpoints=2; final/ 6.4 GiB)\n" in result.output
    big = _model_dir(tmp_path / "big", Q32)
    result = cli.invoke(app, [*args[:-1], f"teacher={big}", f"student={t}", "--gpus", "1", "--gpu-gib", "80"])
    assert result.exit_code == 2
    assert "DOES NOT FIT" in result.output and "error: this run does not fit its GPUs" in result.output
    if not torch.cuda.is_available():  # a CPU run: this machine's memory (agentopd.memory_host), capped by the key
        result = cli.invoke(app, [*args, "run.host_memory_gib=1000", "run.disk_gib=1000"])  # not this machine's disk
        assert result.exit_code == 0 and "GiB available" in result.output and ": fits" in result.output, result.output
        result = cli.invoke(app, [*args, "run.host_memory_gib=8"])
        assert result.exit_code == 2 and "error: this run does not fit this machine's memory" in result.output


def test_out_of_memory_in_the_train_phase_names_it_and_checkpoints(tiny_home, tmp_path, monkeypatch):
    from agentopd.backends.local import LocalBackend
    from agentopd.runner import Runner

    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    train, calls = LocalBackend.train, {"n": 0}

    def oom_at_step_2(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB\nmore lines")
        return train(self, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "train", oom_at_step_2)
    cfg = load_config("sql_db", overrides=[
        "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_new_tokens=16", "rollout.max_turns=2", "eval.num_tasks=2",
        "eval.every=0", "eval.teacher=false", "steps=3", "run.checkpoint_every=0",
        "teacher.selftest_oracle=false"])  # fmt: skip  # the tiny_home teachers are random (conftest)
    s = ModelShape.from_hf_config(Q06)
    monkeypatch.setattr("agentopd.runner.run_plan", lambda *a: plan_memory(cfg, {"student": s}, [80.0]))
    with pytest.raises(OutOfMemory) as err:
        Runner(cfg, tmp_path / "run").run()
    first, *table = str(err.value).splitlines()
    assert first.startswith("CUDA out of memory in the train phase (step 2); checkpoint at step 1")
    assert first.endswith("Tried to allocate 2.32 GiB")
    assert any(line.strip().startswith("0  peak") for line in table)
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "DONE").exists()


def test_engine_sleep_on_the_local_backend_and_the_teachers_eval_engine_closed(cli, tmp_path, monkeypatch):
    """engine.sleep=true: the student's engine frees its pool for the teacher and the trainer, wakes for the next
    rollout; the teacher's engine that played the first eval is closed after it."""
    from agentopd.backends.local import LocalBackend

    closed = []
    collect = LocalBackend.collect

    def watch(self, handle, on_episode=None):
        out = collect(self, handle, on_episode)
        closed.append((handle.who, sorted(self.players.engines)))
        return out

    monkeypatch.setattr(LocalBackend, "collect", watch)
    run = tmp_path / "run"
    result = cli("run", "--env", "sql_db", "--run-dir", run, "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_new_tokens=16",
                 "rollout.max_turns=2", "eval.num_tasks=2", "eval.every=0", "steps=2", "engine.sleep=true",
                 "teacher.selftest_oracle=false")  # fmt: skip  # the tiny_home teachers are random (conftest)
    assert result.exit_code == 0, result.output
    assert ("teacher", ["student"]) in closed  # its engine is gone once its eval is played
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert all(r["perf/engine_sleep_s"] >= 0 and "perf/engine_wake_s" in r for r in records[1:])


def test_run_refused_by_its_plan_loads_no_model_and_leaves_no_run_directory(cli, tmp_path, monkeypatch):
    """`agentopd run` with a plan that cannot fit (as on CUDA; the plan is patched in here): exit 2, the error line
    and the table, before the backend loads a model."""
    from agentopd.backends.local import LocalBackend

    def refuse(cfg, device, student_ref, teacher_refs):
        plan = plan_memory(cfg, {"student": ModelShape.from_hf_config(Q8), "teacher": ModelShape.from_hf_config(Q32)}, [80.0])
        plan.check()

    def no_models(self, *args):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("agentopd.runner.run_plan", refuse)
    monkeypatch.setattr(LocalBackend, "setup", no_models)
    t0 = time.perf_counter()
    result = cli("run", "--env", "sql_db", "--run-dir", tmp_path / "run", "steps=1")
    assert result.exit_code == 2
    assert "error: this run does not fit its GPUs" in result.output and "DOES NOT FIT" in result.output
    assert not (tmp_path / "run").exists()
    assert time.perf_counter() - t0 < 30  # the tiny models' tokenizer and pair check, no model load


def test_out_of_memory_while_loading_the_models_names_the_setup_phase(tiny_home, tmp_path, monkeypatch):
    from agentopd.backends.local import LocalBackend
    from agentopd.runner import Runner

    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))

    def oom(self, *args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(LocalBackend, "setup", oom)
    with pytest.raises(OutOfMemory, match=r"^CUDA out of memory in the setup phase \(loading the models\): CUDA out of memory. Tried"):
        Runner(load_config("sql_db", overrides=["steps=1"]), tmp_path / "run").run()


def test_teacher_offload_auto_keeps_a_teacher_resident_only_where_it_fits():
    """teacher.offload=auto: resident (no copy of its weights a step) when every phase fits with it there; offloaded
    beside a 1.7B trainer on one GPU, with several local teachers, and under engine.kv_cache_fraction."""
    q06, q17, q8 = (ModelShape.from_hf_config(c) for c in (Q06, Q17, Q8))
    small = plan_memory(load_config("sql_db", overrides=["trainer.micro_batch_tokens=16384"]), {"student": q06, "teacher": q17}, [79.2])
    assert small.fits and not small.teacher_offload and not small.engine_sleep
    weights = _item(small, "bf16 weights")
    assert weights.role == "teacher" and set(weights.phases) == set(Phase)  # held in the rollout and train phases too
    assert "teacher.offload off" in small.table()

    example = load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml")
    one = plan_memory(example, {"student": q17, "teacher": q8}, [79.2])
    assert one.fits and one.teacher_offload and not one.engine_sleep  # resident: 80 GiB in the train phase
    assert _item(one, "bf16 weights").phases == (Phase.TEACHER,)
    assert any(n.startswith("teacher.offload=auto: on") for n in one.notes)
    resident = plan_memory(load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml", overrides=["teacher.offload=false"]),
                           {"student": q17, "teacher": q8}, [79.2])  # fmt: skip
    # resident only with the engine asleep and the teacher's eval engine on a 5 GiB pool (what the eval phase leaves)
    assert resident.fits and resident.engine_sleep and 4 < resident.teacher_eval_kv_gib < 6
    resident_cfg = load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml", overrides=[
        "teacher.offload=false", "trainer.micro_batch_tokens=131072"])  # fmt: skip
    tighter = plan_memory(resident_cfg, {"student": q17, "teacher": q8}, [79.2])  # fits with a smaller micro-batch
    assert tighter.fits and tighter.micro_batch_tokens < 131072
    with pytest.raises(MemoryPlanError, match="teacher.offload=true"):  # not even at the smallest micro-batch
        plan_memory(resident_cfg, {"student": q17, "teacher": q8}, [50.0]).check()

    two = plan_memory(load_config("sql_db", config_file="configs/examples/qwen3-2gpu.yaml"), {"student": q17, "teacher": q8}, [79.2] * 2)
    assert two.fits and not two.teacher_offload  # the teacher's GPU has room for it between scorings

    cfg = load_config("sql_db", overrides=["trainer.micro_batch_tokens=16384"])
    assert plan_memory(cfg, {"student": q06, "teacher": q17}, [79.2], teachers=2).teacher_offload
    fraction = load_config("sql_db", overrides=["engine.kv_cache_fraction=0.5"])
    assert plan_memory(fraction, {"student": q06, "teacher": q17}, [79.2]).teacher_offload  # the room goes to the pool


def test_the_runs_teacher_follows_the_plans_offload(tiny_home, tmp_path, monkeypatch):
    """The run hands the plan's decision to its teacher: resident, or offloaded after each scoring (a CPU run with
    the plan patched in, as on CUDA)."""
    from agentopd.runner import Runner
    from agentopd.teacher import HFTeacher

    seen = []

    class Recorded(HFTeacher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.offload_after_score)

    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    monkeypatch.setattr("agentopd.teacher.HFTeacher", Recorded)
    cfg = load_config("sql_db", overrides=["rollout.tasks_per_step=2", "rollout.n=1", "rollout.max_new_tokens=8", "rollout.max_turns=1",
                                           "eval.num_tasks=1", "eval.every=0", "eval.teacher=false", "steps=1",
                                           "teacher.selftest=false"])  # fmt: skip  # its student scorer is an HFTeacher too
    for offload in (False, True):
        plan = plan_memory(cfg, {"student": ModelShape.from_hf_config(Q06)}, [80.0])
        plan.teacher_offload = offload
        monkeypatch.setattr("agentopd.runner.run_plan", lambda *a, plan=plan: plan)
        Runner(cfg, tmp_path / f"run-{offload}").run()
        assert seen[-1] is offload


def test_agentopd_run_under_torchrun_is_refused_on_the_local_backend(cli, tmp_path, monkeypatch):
    """torchrun would start one independent run per process: refused at once, pointing at the Ray backend."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = cli("run", "--env", "sql_db", "--run-dir", tmp_path / "run", "steps=1")
    assert result.exit_code == 2
    assert "under torchrun (WORLD_SIZE=2)" in result.output and "run.backend=ray" in result.output
    assert not (tmp_path / "run").exists()


def test_ray_memory_peaks_sum_the_actors_the_plan_puts_on_each_gpu():
    """RayBackend.memory_peaks: each actor's peak, summed per GPU of the run's placement, a server teacher's clients on
    none (no GPUs here: the actors and `ray` are small fakes that answer `memory_peak` as the real actors do on CUDA)."""
    from types import SimpleNamespace

    from agentopd.backends.placement import Cluster, place
    from agentopd.backends.ray import RayBackend

    def actor(gib, retries=0):
        return SimpleNamespace(memory_peak=SimpleNamespace(remote=lambda: PhaseMemory(gib, gib / 2, retries)))

    cfg = load_config("sql_db", config_file="configs/examples/qwen3-2gpu.yaml")  # trainer GPU 0; engine + teacher GPU 1
    backend = RayBackend()
    backend.ctx = SimpleNamespace(cfg=cfg)
    backend.ray = SimpleNamespace(get=lambda refs: refs)
    backend.group = SimpleNamespace(ranks=[actor(40.0)])
    backend.workers = [actor(20.5, retries=1)]
    backend.teachers = {"default": [actor(18.0, retries=3)]}  # the allocator's retries of the actors sharing GPU 1
    two_gpus = Cluster(cpus=16, gpus=2, free_cpus=16, free_gpus=2, node_cpus=16, node_gpus=2)
    backend.placement = place(cfg.ray, ["default"], two_gpus)
    assert backend.memory_peaks() == {0: pytest.approx((40.0, 20.0, 0)), 1: pytest.approx((38.5, 19.25, 4))}
    # a second teacher behind a server: its client (no GPU share) is not counted on any GPU
    backend.teachers["server"] = [actor(99.0)]
    backend.placement = place(cfg.ray, ["default", "server"], two_gpus, servers={"server"})
    assert backend.memory_peaks() == {0: pytest.approx((40.0, 20.0, 0)), 1: pytest.approx((38.5, 19.25, 4))}
    assert measure_since_last() == (0.0, 0.0, 0)  # a process without CUDA measures nothing


def test_ray_teacher_head_is_fetched_once_and_handed_on_by_its_ref():
    """RayBackend.teacher_head: the head crosses the object store once per run, not twice a step (fakes of `ray` and
    of the teacher actor, as above)."""
    from types import SimpleNamespace

    from agentopd.backends.ray import RayBackend

    fetched, puts = [], []
    head = torch.ones(4, 2)

    def head_weight():
        fetched.append(1)
        return head

    backend = RayBackend()
    backend._heads = {}
    backend.teachers = {"default": [SimpleNamespace(head_weight=SimpleNamespace(remote=head_weight))]}
    backend.ray = SimpleNamespace(get=lambda ref: ref, put=lambda obj: puts.append(obj) or f"ref{len(puts)}")
    first = backend.teacher_head("default")
    assert backend.teacher_head("default") is first and len(fetched) == 1 and len(puts) == 1
    assert backend._head_ref(first) == "ref1" and backend._head_ref([first]) == ["ref1"]
    assert backend._head_ref(torch.zeros(1)) == "ref2"  # a head it did not give: put as before


def test_the_memory_gpu_benchmark_runs_at_toy_sizes(tmp_path):
    """benchmarks/memory_gpu.py --tiny (CPU: no plan, no measured peaks): the models built side by side, the run, the
    report with its step count (what a GPU call relies on)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "memory_gpu.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300, cwd=script.parent.parent)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = (tmp_path / "memory_gpu.md").read_text()
    assert "run exit 0" in report and "2 steps finished" in report
    assert (tmp_path / "memory_gpu_log.txt").read_text() and (tmp_path / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_the_memory_gpu_benchmark_stops_with_a_checkpoint_and_resumes(tmp_path):
    """memory_gpu.py --timeout interrupts the run as Ctrl-C does (it checkpoints), and --resume in a later call
    continues it from the models and run directory under --work: every step played once (a run longer than one
    device call, in two)."""
    import subprocess
    import sys
    from pathlib import Path

    from _faults import loss_steps

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "memory_gpu.py"
    common = [sys.executable, str(script), "--tiny", "--work", str(tmp_path / "work"), "run.steps=8"]
    # --timeout 1 falls in the run's set-up, where a Ctrl-C would end it with nothing written: the interrupt waits
    # until the run's step loop takes it, and the run still stops with a checkpoint
    first = subprocess.run([*common, "--out", str(tmp_path / "a"), "--timeout", "1", "--grace", "60"],
                           capture_output=True, text=True, timeout=300, cwd=script.parent.parent)  # fmt: skip
    report = (tmp_path / "a" / "memory_gpu.md").read_text()
    stopped_at = len(loss_steps(tmp_path / "a"))  # the run's metrics.jsonl, copied into --out
    assert re.search(rf"interrupted after \d+ s \(step_{stopped_at:06d} written\)", report), first.stdout[-2000:] + first.stderr[-2000:]
    assert 0 < stopped_at < 8
    log = (tmp_path / "a" / "memory_gpu_log.txt").read_text().splitlines()
    assert log and all(re.match(r"\[ *\d+ s\] ", line) for line in log)  # each line stamped with the run's seconds
    second = subprocess.run([*common, "--out", str(tmp_path / "b"), "--resume", "--timeout", "240"],
                            capture_output=True, text=True, timeout=300, cwd=script.parent.parent)  # fmt: skip
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    report = (tmp_path / "b" / "memory_gpu.md").read_text()
    assert "run exit 0" in report and "8 steps finished (resumed from step_" in report
    assert loss_steps(tmp_path / "b") == list(range(1, 9))
    # a fresh machine has no run to continue: said in one line, nothing run
    gone = subprocess.run([*common[:3], "--work", str(tmp_path / "empty"), "--out", str(tmp_path / "c"), "--resume"],
                          capture_output=True, text=True, timeout=120, cwd=script.parent.parent)  # fmt: skip
    assert gone.returncode != 0 and "--resume: no run to continue" in gone.stderr


def test_a_teacher_that_plays_is_counted_with_its_engine_and_pure_sft_loads_no_scorer():
    """A teacher that plays training episodes does it on an engine of its own (backends.stages.Players): bf16 weights
    and a KV pool as large as the student's, in every phase; under objective=sft its scorer never loads."""
    shapes = {"student": ModelShape.from_hf_config(Q17), "teacher": ModelShape.from_hf_config(Q8)}
    keys = ["engine.sleep=false", "teacher.offload=false", "engine.kv_cache_gib=8", "eval.teacher=false", "teacher.selftest=false"]

    def plan(*extra):
        return plan_memory(load_config("sql_db", overrides=[*keys, *extra]), shapes, [200.0])

    opd, sft, mixed = plan(), plan("run.objective=sft"), plan("recipe.teacher_fraction=0.5")
    weights = 2 * shapes["teacher"].params / GIB
    assert not [i for i in opd.items if i.what.startswith("teacher's play engine")]
    assert _item(sft, "teacher's play engine").gib == pytest.approx(weights + 8.0)
    assert not [i for i in sft.items if i.role == "teacher"]  # no scorer
    assert _item(mixed, "teacher's play engine").gib == pytest.approx(weights + 8.0) and _item(mixed, "bf16 weights")
    assert mixed.peak(0, Phase.ROLLOUT) == pytest.approx(opd.peak(0, Phase.ROLLOUT) + weights + 8.0)
    # a cross-tokenizer run skips the teacher's eval: its engine is not counted
    cross = plan_memory(load_config("sql_db", overrides=["engine.kv_cache_gib=8", "trainer.loss=xtok_k1"]), shapes, [200.0])
    assert not [i for i in cross.items if i.what.startswith("teacher's engine")]


def test_the_teachers_eval_engine_takes_the_pool_its_phase_leaves_and_the_run_builds_it_so(monkeypatch):
    """A 64 GiB pool for 512 episodes in flight fits an H200's rollout phase, but the teacher's eval engine took a pool
    as large beside the student's (167 GiB): it now takes what the eval phase leaves, at most engine.kv_cache_gib and
    at least one context of rollout.max_context, says so, and the run's teacher engine is built with it."""
    import agentopd.backends.stages as stages

    shapes = {"student": ModelShape.from_hf_config(Q17), "teacher": ModelShape.from_hf_config(Q8)}
    keys = ["engine.kv_cache_gib=64", "rollout.concurrency=512", "engine.max_batch_size=512", "teacher.selftest=false"]
    plan = plan_memory(load_config("sql_db", overrides=keys), shapes, [139.8])
    pool = _item(plan, "teacher's engine: KV pool").gib
    assert plan.fits and 0 < pool < 64 and plan.teacher_eval_kv_gib == pytest.approx(pool)
    assert plan.peak(0, Phase.EVAL) == pytest.approx(0.95 * 139.8)  # exactly what the phase leaves
    assert any("the teacher's eval engine: a KV pool of" in n for n in plan.notes)
    # where the pool fits, it is the run's, and nothing is said
    roomy = plan_memory(load_config("sql_db", overrides=keys), shapes, [400.0])
    assert _item(roomy, "teacher's engine: KV pool").gib == 64 and roomy.teacher_eval_kv_gib is None
    # no room at all: one context of the teacher's K/V, and the plan refuses the run
    tight = plan_memory(load_config("sql_db", overrides=[*keys, "engine.sleep=false", "teacher.offload=false"]), shapes, [100.0])
    one_context = shapes["teacher"].kv_bytes_per_token() * load_config("sql_db").rollout.max_context / GIB
    assert not tight.fits and _item(tight, "teacher's engine: KV pool").gib == pytest.approx(one_context)

    class Ctx:  # what Players reads of a RunContext
        teacher_eval_kv_gib, own_tokenizer = 12.5, frozenset()

        def model_ref(self, who):
            return f"/models/{who}"

    built = {}

    def record(ctx, model, vocab_size=-1, share=False, kv_cache_gib=None):  # a fast engine's pool needs CUDA: recorded
        built[model] = kv_cache_gib
        return object()

    monkeypatch.setattr(stages, "build_engine", record)
    players = stages.Players.__new__(stages.Players)  # what engine() reads of one, without an event loop
    players.ctx, players.module_of, players.engines = Ctx(), None, {}
    players.engine("teacher")
    players.engine("student")
    assert built == {"/models/teacher": 12.5, "/models/student": None}
    assert stages.RunContext.__dataclass_fields__["teacher_eval_kv_gib"].default is None


def test_the_plan_says_when_rollout_concurrency_leaves_the_engines_batch_unfilled():
    """configs/examples/qwen3-gpu.yaml decoded ~54 rows a step of its engine.max_batch_size 256 because 64 episodes were
    in flight (rollout.concurrency's default; realsize_profile.md): the plan says so, and not once they match."""
    shapes = {"student": ModelShape.from_hf_config(Q17), "teacher": ModelShape.from_hf_config(Q8)}
    example = "configs/examples/qwen3-gpu.yaml"
    notes = plan_memory(load_config("sql_db", config_file=example), shapes, [139.0]).notes
    assert any("rollout.concurrency=64 episodes in flight" in n and "engine.max_batch_size=256" in n for n in notes)
    filled = plan_memory(load_config("sql_db", config_file=example, overrides=["rollout.concurrency=256"]), shapes, [139.0])
    assert not any("rollout.concurrency" in n for n in filled.notes)


def test_activations_shrink_where_the_train_phase_cannot_fit_and_the_run_takes_them():
    """No sleep/offload choice fits with the configured trainer: the plan turns activation checkpointing on, then halves
    the micro-batch, until the train phase fits (as the host plan does on a CPU), and says so; the run's trainer takes
    those settings (run_parts.fit_gpu). Where nothing fits, the refusal shows the plan with the configured ones."""
    from agentopd.policy import trainer_config
    from agentopd.run_parts import fit_gpu

    shapes = {"student": ModelShape.from_hf_config(Q17), "teacher": ModelShape.from_hf_config(Q06)}
    keys = ["trainer.loss=reverse_kl", "eval.teacher=false", "engine.sleep=true", "teacher.offload=true"]

    def config(ac: bool, tokens: int):
        return load_config("sql_db", overrides=[*keys, f"trainer.activation_checkpointing={str(ac).lower()}",
                                                f"trainer.micro_batch_tokens={tokens}"])  # fmt: skip

    def train(ac: bool, tokens: int) -> float:  # the train phase's peak (the largest phase here)
        plan = plan_memory(config(ac, tokens), shapes, [1e3])
        assert plan.peak(0, Phase.TRAIN) == max(plan.peak(0, ph) for ph in Phase)
        return plan.peak(0, Phase.TRAIN)

    assert train(True, 32768) < train(True, 65536) < train(True, 131072) < train(False, 32768) < train(False, 131072)
    cfg = config(False, 131072)
    # room for checkpointed activations at 131,072 tokens, not for them unchecked at 32,768: checkpointing, same size
    ckpt = plan_memory(cfg, shapes, [(train(True, 131072) + train(False, 32768)) / 2 / 0.95])
    assert ckpt.fits and ckpt.activation_checkpointing and ckpt.micro_batch_tokens == 131072
    assert ckpt.notes[-1] == "trainer.activation_checkpointing false -> true: the train phase did not fit without it"
    trainer_cfg, line = fit_gpu(ckpt, trainer_config(cfg))
    assert trainer_cfg.activation_checkpointing and trainer_cfg.micro_batch_tokens == 131072
    assert line == "memory (GPU): trainer.activation_checkpointing false -> true: the train phase did not fit without it"
    # room for 32,768 checkpointed tokens, not for 65,536
    small = plan_memory(cfg, shapes, [(train(True, 32768) + train(True, 65536)) / 2 / 0.95])
    assert small.fits and small.activation_checkpointing and small.micro_batch_tokens == 32768
    assert any(n.startswith("trainer.micro_batch_tokens 131072 -> 32768: the train phase did not fit at 131072") for n in small.notes)
    assert _item(small, "activations").what.startswith("activations, 32768 tok, checkpointed")
    trainer_cfg, line = fit_gpu(small, trainer_config(cfg))
    assert (trainer_cfg.activation_checkpointing, trainer_cfg.micro_batch_tokens) == (True, 32768)
    assert "activation_checkpointing false -> true" in line and "micro_batch_tokens 131072 -> 32768" in line
    roomy = plan_memory(cfg, shapes, [500.0])
    assert (roomy.activation_checkpointing, roomy.micro_batch_tokens) == (False, 131072) and roomy.fits
    assert fit_gpu(roomy, trainer_config(cfg)) == (trainer_config(cfg), None)
    refused = plan_memory(cfg, shapes, [20.0])  # the models alone are more than that
    assert not refused.fits and _item(refused, "activations").what.startswith("activations, 131072 tok, no checkpointing")
    with pytest.raises(MemoryPlanError, match="trainer.micro_batch_tokens"):
        refused.check()


def test_a_refusal_offers_the_trainers_keys_only_where_the_train_phase_does_not_fit():
    """trainer.micro_batch_tokens and activation checkpointing shrink the train phase alone: a run whose train phase
    fits but whose eval phase (the teacher's eval engine) does not is not told to change them."""
    shapes = {"student": ModelShape.from_hf_config(Q17), "teacher": ModelShape.from_hf_config(Q8)}
    cfg = load_config("sql_db", config_file="configs/examples/qwen3-gpu.yaml")
    plan = plan_memory(cfg, shapes, [55.0])
    assert plan.peak(0, Phase.TRAIN) <= 0.95 * 55.0 < plan.peak(0, Phase.EVAL)
    with pytest.raises(MemoryPlanError) as err:
        plan.check()
    first = str(err.value).splitlines()[0]
    assert "in the eval phase" in first and "eval.teacher=false" in first
    assert "trainer.micro_batch_tokens" not in first and "trainer.activation_checkpointing" not in first
    small = plan_memory(cfg, shapes, [30.0])  # there the train phase does not fit either
    with pytest.raises(MemoryPlanError, match="keys to change: trainer.micro_batch_tokens"):
        small.check()
