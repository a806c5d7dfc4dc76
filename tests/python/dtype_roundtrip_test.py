"""A PyTorch model of fp32, bf16 and fp16 parameters, a 0-d parameter and BatchNorm's buffers (running
statistics in fp32, num_batches_tracked in int64) through a real estuary-server, bit for bit.

Two sites, two rounds. The sites receive the initial weights widened exactly to fp32 (the int64 buffer
stays at the site), and in round 1 return them negated in their own dtypes, as torch tensors; in round 2
they check that they received exactly those and return them negated again. Negation is exact in every
dtype and so is FedAvg of two equal updates of equal weight (local - global = -2 w, its mean, and
w + (-2 w) = -w), so the export of round 1 must be the negated model and that of round 2 the initial one,
bit for bit in each tensor's own dtype, with num_batches_tracked as the initial file had it.
"""

import tempfile
import threading
import time
import unittest

import numpy as np
import torch

import estuary


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2).to(torch.bfloat16)
        self.c = torch.nn.Parameter(torch.randn(5).to(torch.float16))
        self.scale = torch.nn.Parameter(torch.tensor(0.75))
        self.bn = torch.nn.BatchNorm1d(3)


def initial_model():
    torch.manual_seed(3)
    model = Mixed()
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.randn(3))
        model.bn.running_var.copy_(torch.rand(3) + 0.5)
        model.bn.num_batches_tracked.fill_(1234567)
        model.bn.weight.copy_(torch.rand(3) + 0.5)
        model.bn.bias.copy_(torch.rand(3) + 0.1)  # no zeros: -0.0 would average to +0.0
        model.c[0] = 6.0e-8  # an fp16 subnormal
    return model


def bits(t):
    """A tensor's bit pattern, whatever its dtype, as a NumPy array."""
    t = t.detach().contiguous()
    views = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.view(views.get(t.dtype, t.dtype)).numpy()


class RoundTrip(unittest.TestCase):
    def test_every_dtype_survives_the_server_bit_for_bit(self):
        model = initial_model()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        floating = {k for k, v in state.items() if v.is_floating_point()}
        self.assertEqual(state["bn.num_batches_tracked"].dtype, torch.int64)
        problems = []

        def fit(weights, config):
            try:
                self.assertEqual(set(weights), floating)  # the int64 buffer is not sent
                for name, array in weights.items():
                    self.assertEqual(array.dtype, np.float32)
                    self.assertFalse(array.flags.writeable)
                    expected = state[name].float() * (-1 if config["round"] == 2 else 1)
                    shape = list(expected.shape) or [1]  # a 0-d tensor travels as [1]
                    self.assertEqual(list(array.shape), shape, name)
                    np.testing.assert_array_equal(array.view(np.int32), bits(expected.reshape(shape)), name)
                # Back in each tensor's own dtype, negated; the int64 buffer is returned too and ignored.
                module = Mixed()
                estuary.load_weights(module, weights)
                out = {k: (-v if v.is_floating_point() else v + 1) for k, v in module.state_dict().items()}
                for name in floating:
                    self.assertEqual(out[name].dtype, state[name].dtype, name)
                return out, 8, {"loss": 0.5}
            except Exception as error:
                problems.append(f"round {config['round']}: {error}")
                raise

        with tempfile.TemporaryDirectory() as d:
            server = estuary.LocalServer(d, model, ["site-0", "site-1"], rounds=2, flags=["--round-deadline", "60"])
            results = [None, None]

            def run(k):
                results[k] = estuary.Client(server.address, **server.site_files(f"site-{k}"), max_backoff_s=1,
                                            expected_model=model).run(fit)

            with server.start():  # stops the server however the test ends
                threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(2)]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 120  # a failing fit leaves its round open until then
                for t in threads:
                    t.join(max(0.0, deadline - time.monotonic()))
                server.wait(10)
            self.assertIn(f"model {estuary.model_name(model)}", server.log_tail(1000))
            self.assertEqual(problems, [])
            self.assertEqual([r.rounds_trained for r in results], [2, 2])
            for round, sign in ((1, -1), (2, 1)):
                exported = server.export(round=round, as_torch=True)
                self.assertEqual(set(exported), set(state))
                for name, t in state.items():
                    got = exported[name]
                    self.assertEqual(got.dtype, t.dtype, name)
                    self.assertEqual(tuple(got.shape), tuple(t.shape), name)
                    want = t * sign if name in floating else t  # held: as the initial file had it
                    np.testing.assert_array_equal(bits(got), bits(want), f"round {round}: {name}")


if __name__ == "__main__":
    unittest.main()
