"""torch._dynamo, imported when first needed, on a thread of its own.

torch imports torch._dynamo lazily: on torch.optim's first `add_param_group` (an optimizer's construction) and
on the first `torch.compile`. That import calls torch.fx's `wrap` at the top of torch/_dynamo/utils.py, whose
frame keeps a reference to itself (its local `currentframe`) and to the importing frame, whose `f_back` chain
reaches every caller's frame: the first model and optimizer built in a process would stay alive after `del`,
every byte of them, until a gc collection (tests/test_memory_release.py). Imported on a short-lived thread,
that chain ends at the thread's start, which holds nothing of ours. Imported at start-up instead, every
process would pay ~1 s for it (`--help` and a bad flag included), most of them for nothing.
"""

import sys
import threading


def import_dynamo() -> None:
    """Import torch._dynamo (once per process) on a thread of its own; call before what would import it."""
    if "torch._dynamo" in sys.modules:
        return
    failure = []

    def load():
        try:
            import torch._dynamo  # noqa: F401
        except BaseException as e:  # re-raised on the caller's thread
            failure.append(e)

    thread = threading.Thread(target=load, name="import torch._dynamo")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
