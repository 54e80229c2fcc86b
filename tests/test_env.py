"""detect_env is a pure function of a mapping: torchrun > srun > single."""

from __future__ import annotations

import pytest

from ddp_amp.env import DistEnv, detect_env, expand_nodelist
from ddp_amp.errors import UsageError

TORCHRUN = {
    "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
    "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job7",
    "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
}
SRUN = {
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "6", "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_STEP_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "123456",
    "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_RESTART_COUNT": "1",
}


def test_single_process_without_launcher_variables() -> None:
    env = detect_env({"HOME": "/root"})
    assert env == DistEnv() and env.launcher == "single" and not env.is_distributed


def test_torchrun_variables() -> None:
    env = detect_env(TORCHRUN)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (3, 1, 4, 2, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("node0", 29400, "torchrun")
    assert (env.restart_count, env.run_id, env.agent_hosts_store, env.under_agent) == (2, "job7", True, True)
    # torch 2.4's agent says it does not host the store: it is the worker's parent all the same
    older = detect_env({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not older.agent_hosts_store and older.under_agent
    assert not detect_env({key: value for key, value in TORCHRUN.items()
                           if key != "TORCHELASTIC_USE_AGENT_STORE"}).under_agent  # a hand-made env:// launch


def test_srun_variables_expand_the_nodelist_and_derive_the_port() -> None:
    env = detect_env(SRUN)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (5, 1, 6, 2, 2)
    assert env.master_addr == "gpu07" and env.launcher == "slurm" and env.restart_count == 1
    assert env.master_port == 20000 + 123456 % 10000 and env.run_id == "123456"


def test_torchrun_wins_inside_a_slurm_allocation() -> None:
    assert detect_env({**SRUN, **TORCHRUN}).launcher == "torchrun"


def test_batch_shell_without_srun_stays_single() -> None:
    batch_shell = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    assert detect_env(batch_shell).launcher == "single"


def test_nodelist_expansion_handles_ranges_lists_and_padding() -> None:
    assert expand_nodelist("a[01-03,7],b5") == ["a01", "a02", "a03", "a7", "b5"]


def test_slurm_restart_count_unset_on_first_run() -> None:
    env = detect_env({k: v for k, v in SRUN.items() if k != "SLURM_RESTART_COUNT"})
    assert env.restart_count == 0


@pytest.mark.parametrize(("changes", "name", "value"), [
    ({"RANK": "x"}, "RANK", "x"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK", 2),
    ({"RANK": "4"}, "RANK", 4),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT", 70000),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE", 0),
])
def test_inconsistent_torchrun_values_name_the_variable(changes: dict[str, str], name: str, value: object) -> None:
    with pytest.raises(UsageError) as error:
        detect_env({**TORCHRUN, **changes})
    assert error.value.what == name and error.value.value == value
    assert name in str(error.value) and "\n" not in str(error.value)


def test_inconsistent_slurm_values_name_the_variable() -> None:
    with pytest.raises(UsageError, match="SLURM_LOCALID"):
        detect_env({**SRUN, "SLURM_LOCALID": "2"})
    with pytest.raises(UsageError, match="SLURM_PROCID"):
        detect_env({**SRUN, "SLURM_PROCID": "six"})


def test_detect_env_does_not_write_the_mapping() -> None:
    mapping = dict(SRUN)
    detect_env(mapping)
    assert mapping == SRUN


def test_run_id_names_this_run_only() -> None:
    from ddp_amp.env.detect import launcher_run_id

    assert launcher_run_id({"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "abc"}) == "77"  # SLURM first
    assert launcher_run_id({"SLURM_JOB_ID": "78", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"}) == "70_3"
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "9f2c-uuid"}) == "9f2c-uuid"  # --standalone's own
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "none"}) == ""  # torchrun's default: every launch's
    assert launcher_run_id({}) == ""
    assert detect_env({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}).run_id == ""
