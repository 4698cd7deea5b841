"""Point-to-point on device tensors: staged through host memory, as ProcessGroupGloo does.

send copies the tensor to a host tensor on the caller's current stream and waits for that
copy (the one host synchronization here), then sends the host tensor through the host
engine's mailboxes; recv receives into a host tensor and, when the message is complete,
copies it into the device tensor on the stream that was current at the recv call, before
the Work completes, so work ordered after `work.wait()` on that stream sees the data.
Collectives stay on the device path (torch_path.py); a device mailbox protocol for
send/recv is future work (it needs tag matching before the receiving stream can be told
which buffer to read).
"""

import torch

__all__ = ["stage_send", "stage_recv"]


def stage_send(t):
    """A host copy of device tensor `t` (synchronous: the copy is done on return)."""
    return t.detach().to("cpu")


def stage_recv(t):
    """(host tensor to receive into, finish()): finish copies it into `t` on the stream
    current now, from whatever thread completes the receive."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    stream = torch.cuda.current_stream(t.device)

    def finish():
        with torch.cuda.stream(stream):
            t.copy_(host, non_blocking=True)
    return host, finish
