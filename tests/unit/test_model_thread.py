"""tandem.model_thread: the model thread keeps the process's intra-op threads, its creator is left one.

Each case runs in a fresh interpreter: confining a thread changes process-wide PyTorch state that must not leak
into the rest of the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, threading
    import torch
    from tandem.model_thread import ModelThread

    torch.set_num_threads(2)
    model = ModelThread("model")
    creator = torch.get_num_threads()
    # A thread started later takes PyTorch's last setting (the creator's 1); the model thread must not.
    later = []
    worker = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    torch.set_num_threads(1)  # the creator asks again: the model thread keeps its own
    product = model.call(lambda: (torch.ones(4, 4) @ torch.ones(4, 4)).sum().item())
    print(json.dumps({
        "model": model.call(torch.get_num_threads),
        "creator": creator,
        "later": later[0],
        "product": product,
        "name": model.call(lambda: threading.current_thread().name),
    }))
    model.shutdown()
    """
)


def test_the_model_thread_keeps_the_intra_op_threads_and_its_creator_gets_one() -> None:
    finished = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(finished.stdout.strip().splitlines()[-1])
    assert seen["model"] == 2
    assert seen["creator"] == 1
    assert seen["later"] == 1
    assert seen["product"] == 64.0
    assert seen["name"].startswith("model")


THREADS_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from tandem.model_thread import ModelThread

    torch.set_num_threads(2)
    model = ModelThread("model", threads=3)
    print(json.dumps({"model": model.call(torch.get_num_threads), "creator": torch.get_num_threads()}))
    model.shutdown()
    try:
        ModelThread("bad", threads=-1)
    except ValueError as error:
        print(json.dumps({"refused": str(error)}))
    """
)


def test_a_thread_count_given_to_the_model_thread_is_what_its_forwards_use() -> None:
    finished = subprocess.run(
        [sys.executable, "-c", THREADS_SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    lines = [json.loads(line) for line in finished.stdout.strip().splitlines()[-2:]]
    assert lines[0] == {"model": 3, "creator": 1}
    assert "threads: -1" in lines[1]["refused"]
