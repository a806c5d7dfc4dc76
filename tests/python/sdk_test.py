"""The Python SDK's names, files and errors; a failing fit and a refused model against a real estuary-server.

Oracles: the model name's recipe as docs/CUSTOM_MODELS.md gives it (hashlib
over the layout), and the safetensors format read here by hand (an 8-byte
header length, a JSON header, the tensors' little-endian bytes) against
torch's own bytes of each tensor.
"""

import hashlib
import json
import struct
import tempfile
import threading
import unittest
from pathlib import Path

import numpy as np
import torch

import estuary

DT = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64", torch.int32: "I32",
      torch.uint8: "U8", torch.bool: "BOOL"}


def recipe_name(sd):
    """docs/CUSTOM_MODELS.md's Python for the model's name."""
    text = "".join(f"{k}\t{DT[t.dtype]}\t{','.join(map(str, t.shape))}\n" for k, t in sorted(sd.items()))
    return "custom@" + hashlib.sha256(text.encode()).hexdigest()[:12]


def every_dtype():
    g = torch.Generator().manual_seed(5)
    return {
        "w32": torch.randn(3, 4, generator=g),
        "wbf16": torch.randn(2, 5, generator=g).to(torch.bfloat16),
        "w16": torch.randn(7, generator=g).to(torch.float16),
        "count": torch.tensor(1234567890123, dtype=torch.int64),
        "i32": torch.arange(-3, 3, dtype=torch.int32),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.375),
        "empty": torch.zeros(0, 4),
    }


def raw(t):
    """A tensor's bytes as torch holds them (bf16 through an int16 view: NumPy has no bfloat16)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def read_safetensors(path):
    data = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    return {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def linear():
    return {"linear.weight": torch.tensor([[0.5, -0.25, 0.125]]), "linear.bias": torch.tensor([0.2])}


class Names(unittest.TestCase):
    def test_model_name_is_the_documented_recipe(self):
        sd = every_dtype()
        self.assertEqual(estuary.model_name(sd), recipe_name(sd))
        # A module's state dict, and NumPy arrays of the same layout, name the same model.
        module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        self.assertEqual(estuary.model_name(module), recipe_name(module.state_dict()))
        as_numpy = {k: v.numpy() for k, v in module.state_dict().items()}
        self.assertEqual(estuary.model_name(as_numpy), recipe_name(module.state_dict()))
        # The name depends on dtypes and shapes.
        changed = dict(sd, w32=torch.randn(4, 3))
        self.assertNotEqual(estuary.model_name(changed), estuary.model_name(sd))


class Files(unittest.TestCase):
    def test_save_writes_torch_bytes_and_load_gives_them_back(self):
        sd = every_dtype()
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "m.safetensors"
            name = estuary.save_model(path, sd)
            self.assertEqual(name, recipe_name(sd))
            on_disk = read_safetensors(path)
            self.assertEqual(sorted(on_disk), sorted(sd))
            for k, t in sd.items():
                dtype, shape, data = on_disk[k]
                self.assertEqual((dtype, shape), (DT[t.dtype], list(t.shape)), k)
                self.assertEqual(data, raw(t), k)
            back = estuary.load_model(path, as_torch=True)
            for k, t in sd.items():
                self.assertEqual(back[k].dtype, t.dtype, k)
                self.assertEqual(tuple(back[k].shape), tuple(t.shape), k)
                self.assertEqual(raw(back[k]), raw(t), k)
            as_numpy = estuary.load_model(path)
            self.assertEqual(as_numpy["wbf16"].dtype, np.float32)  # widened: NumPy has no bfloat16
            np.testing.assert_array_equal(as_numpy["wbf16"], sd["wbf16"].float().numpy())
            self.assertEqual(as_numpy["w16"].dtype, np.float16)

    def test_float64_is_refused_in_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(ValueError) as caught:
                estuary.save_model(Path(d) / "m.safetensors", {"w": np.zeros(3)})
            self.assertIn("tensor 'w' is float64", str(caught.exception))
            self.assertNotIn("\n", str(caught.exception))
            self.assertFalse((Path(d) / "m.safetensors").exists())

    def test_a_damaged_file_is_refused_naming_it(self):
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "m.safetensors"
            estuary.save_model(path, linear())
            path.write_bytes(path.read_bytes()[:-3])
            with self.assertRaises(ValueError) as caught:
                estuary.load_model(path)
            self.assertIn(str(path), str(caught.exception))
            self.assertNotIn("\n", str(caught.exception))


def fit_linear(weights, config):
    return {k: v - config["learning_rate"] for k, v in weights.items()}, 4, {"loss": 1.0}


class Sites(unittest.TestCase):
    def test_a_missing_certificate_raises_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            missing = Path(d) / "absent.pem"
            client = estuary.Client("127.0.0.1:9", cert=missing, key=Path(d) / "absent.key", ca=Path(d) / "ca.pem")
            with self.assertRaises(estuary.SiteError) as caught:
                client.run(fit_linear)
            self.assertIn(str(missing), str(caught.exception))
            self.assertNotIn("\n", str(caught.exception))

    def test_a_site_of_another_model_refuses_the_round_in_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            server = estuary.LocalServer(d, linear(), ["site-0"], rounds=1, flags=["--round-deadline", "60"])
            other = dict(linear(), extra=torch.zeros(2))
            with server.start():
                client = estuary.Client(server.address, **server.site_files("site-0"), expected_model=other,
                                        max_backoff_s=1)
                with self.assertRaises(estuary.SiteError) as caught:
                    client.run(fit_linear)
            line = (f"refused round 1: the federation trains {estuary.model_name(linear())}, this site's model "
                    f"is {estuary.model_name(other)}")
            self.assertIn(line, str(caught.exception))
            self.assertNotIn("\n", str(caught.exception))

    def test_fit_that_raises_withholds_that_round_and_the_site_carries_on(self):
        with tempfile.TemporaryDirectory() as d:
            # Two sites; a round closes at its 3 s deadline with one update.
            server = estuary.LocalServer(d, linear(), ["site-0", "site-1"], rounds=2,
                                         flags=["--round-deadline", "3", "--min-updates", "1", "--lr", "0.5"])
            seen = []

            def flaky(weights, config):
                seen.append(config["round"])
                if config["round"] == 1:
                    raise ValueError("no data\ntoday")
                return fit_linear(weights, config)

            results = {}
            with server.start():
                files = [server.site_files(f"site-{k}") for k in range(2)]
                good = threading.Thread(target=lambda: results.setdefault(
                    "good", estuary.Client(server.address, **files[1], max_backoff_s=1).run(fit_linear)), daemon=True)
                good.start()
                results["flaky"] = estuary.Client(server.address, **files[0], max_backoff_s=1).run(flaky)
                good.join(60)
                server.wait(60)
            self.assertEqual(seen, [1, 2])
            self.assertEqual(results["flaky"].failures, [(1, "ValueError: no data today")])
            self.assertEqual(results["flaky"].rounds_trained, 1)
            self.assertEqual(results["good"].rounds_trained, 2)
            self.assertEqual(results["good"].failures, [])
            statuses = {p["client"]: p["status"] for p in server.round(1)["participants"]}
            self.assertEqual(statuses, {"site-0": "failed", "site-1": "committed"})
            reasons = {p["client"]: p["detail"] for p in server.round(1)["participants"]}
            self.assertIn("fit raised ValueError: no data", reasons["site-0"])
            statuses = {p["client"]: p["status"] for p in server.round(2)["participants"]}
            self.assertEqual(statuses, {"site-0": "committed", "site-1": "committed"})
            # Round 1 is the good site's update alone; round 2 both, from there.
            model = server.export()
            np.testing.assert_allclose(model["linear.bias"], [0.2 - 0.5 - 0.5], rtol=1e-6)

    def test_fednova_weighs_each_fit_by_the_steps_it_reports(self):
        # Two sites of 4 examples each: site-0 moves -lr in 1 step, site-1 -2 lr in 4. FedNova
        # (Wang et al. 2020, plain SGD: a_i = steps): tau_eff = 2.5, sum p_i d_i / a_i = -0.75 lr,
        # so the bias moves -1.875 lr, where FedAvg's mean of the deltas would move it -1.5 lr.
        with tempfile.TemporaryDirectory() as d:
            lr = 0.1
            server = estuary.LocalServer(d, linear(), ["site-0", "site-1"], rounds=1,
                                         flags=["--strategy", "fednova", "--lr", str(lr), "--max-local-seconds", "7.5"])
            caps = []

            def stepper(scale, steps):
                def fit(weights, config):
                    caps.append(config["max_local_seconds"])
                    return ({k: v - scale * config["learning_rate"] for k, v in weights.items()}, 4,
                            {"loss": 1.0, "local_steps": steps})
                return fit

            results = {}
            with server.start():
                threads = []
                for k, (scale, steps) in enumerate([(1, 1), (2, 4)]):
                    files = server.site_files(f"site-{k}")
                    t = threading.Thread(target=lambda k=k, files=files, fit=stepper(scale, steps): results.setdefault(
                        k, estuary.Client(server.address, **files, max_backoff_s=1).run(fit)), daemon=True)
                    t.start()
                    threads.append(t)
                for t in threads:
                    t.join(60)
                server.wait(60)
            self.assertEqual(caps, [7.5, 7.5])
            self.assertEqual([results[k].failures for k in range(2)], [[], []])
            model = server.export()
            np.testing.assert_allclose(model["linear.bias"], [0.2 - 1.875 * lr], rtol=1e-6)

    def test_local_steps_that_are_not_a_whole_number_fail_the_round_in_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            server = estuary.LocalServer(d, linear(), ["site-0", "site-1"], rounds=1,
                                         flags=["--round-deadline", "3", "--min-updates", "1"])

            def fit(weights, config):
                update, n, metrics = fit_linear(weights, config)
                return update, n, {**metrics, "local_steps": 2.5}

            results = {}
            with server.start():
                files = [server.site_files(f"site-{k}") for k in range(2)]
                good = threading.Thread(target=lambda: results.setdefault(
                    "good", estuary.Client(server.address, **files[1], max_backoff_s=1).run(fit_linear)), daemon=True)
                good.start()
                results["bad"] = estuary.Client(server.address, **files[0], max_backoff_s=1).run(fit)
                good.join(60)
                server.wait(60)
            self.assertEqual(results["bad"].failures, [(1, "ValueError: fit returned metrics['local_steps'] = 2.5: "
                                                           "expected a whole number >= 1 (the optimizer steps it took)")])
            statuses = {p["client"]: p["status"] for p in server.round(1)["participants"]}
            self.assertEqual(statuses, {"site-0": "failed", "site-1": "committed"})

    def test_evaluate_answers_the_servers_evaluation_rounds_weighted_by_examples(self):
        with tempfile.TemporaryDirectory() as d:
            server = estuary.LocalServer(d, linear(), ["site-0", "site-1", "site-2"], rounds=2,
                                         flags=["--evaluate-every", "1", "--evaluate-clients", "0"])
            seen = {}

            # Each site scores what it is sent: site k reports loss k + 1 over 10 (k + 1) examples,
            # accuracy 0.1 (k + 1), and the bias it received, so the test knows which model it scored.
            def scorer(k):
                def evaluate(weights, config):
                    seen.setdefault(k, []).append((config["round"], float(weights["linear.bias"][0])))
                    if k == 2:
                        raise RuntimeError("no held-out data here")
                    return float(k + 1), 10 * (k + 1), {"accuracy": 0.1 * (k + 1)}
                return evaluate

            rates = []

            def fit(weights, config):
                rates.append(config["learning_rate"])
                return fit_linear(weights, config)

            results = {}
            with server.start():
                threads = []
                for k in range(3):
                    files = server.site_files(f"site-{k}")
                    t = threading.Thread(target=lambda k=k, files=files: results.setdefault(
                        k, estuary.Client(server.address, **files, max_backoff_s=1).run(fit, scorer(k))),
                        daemon=True)
                    t.start()
                    threads.append(t)
                for t in threads:
                    t.join(60)
                server.wait(60)
            for rnd in (1, 2):
                e = server.round(rnd)["federated_evaluation"]
                self.assertEqual(e["sites_reported"], 2)
                self.assertEqual(e["sites_failed"], 1)
                self.assertEqual(e["examples"], 30)
                self.assertAlmostEqual(e["loss"], (1 * 10 + 2 * 20) / 30, places=12)
                self.assertAlmostEqual(e["accuracy"], (0.1 * 10 + 0.2 * 20) / 30, places=12)
            self.assertEqual(results[2].evaluation_failures,
                             [(1, "RuntimeError: no held-out data here"), (2, "RuntimeError: no held-out data here")])
            self.assertEqual(results[0].evaluation_failures, [])
            # The model scored after round r is the one round r committed: bias 0.2 - r * lr.
            self.assertEqual([r for r, _ in seen[0]], [1, 2])
            for r, bias in seen[0]:
                self.assertAlmostEqual(bias, 0.2 - r * rates[0], places=6)

    def test_a_result_of_the_wrong_shape_is_the_rounds_failure_in_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            # One site: the round fails at its 2 s deadline and is tried again.
            server = estuary.LocalServer(d, linear(), ["site-0"], rounds=1, flags=["--round-deadline", "2"])
            calls = []

            def fit(weights, config):
                calls.append(config["round"])
                new, examples, metrics = fit_linear(weights, config)
                if len(calls) == 1:
                    new["linear.bias"] = np.zeros(2, np.float32)
                if len(calls) == 2:
                    del new["linear.weight"]
                return new, examples, metrics

            with server.start():
                result = estuary.Client(server.address, **server.site_files("site-0"), max_backoff_s=1).run(fit)
                server.wait(60)
            self.assertEqual([message for _, message in result.failures], [
                "ValueError: fit returned tensor 'linear.bias' of shape [2], the global model's is [1]",
                "ValueError: fit returned no tensor 'linear.weight'"])
            self.assertEqual(len(calls), 3)
            self.assertEqual(result.rounds_trained, 1)

    def test_received_arrays_are_read_only_views_that_outlive_fit(self):
        with tempfile.TemporaryDirectory() as d:
            server = estuary.LocalServer(d, linear(), ["site-0"], rounds=3, flags=["--lr", "0.25"])
            kept, copies = [], []

            def fit(weights, config):
                for array in weights.values():
                    self.assertFalse(array.flags.writeable)
                    self.assertFalse(array.flags.owndata)  # a view of the agent's buffer, not a copy
                    with self.assertRaises(ValueError):
                        array[...] = 0
                kept.append((weights, weights["linear.weight"][0, 1:], torch.from_numpy(weights["linear.bias"])))
                copies.append({k: v.copy() for k, v in weights.items()})
                return fit_linear(weights, config)

            with server.start():
                result = estuary.Client(server.address, **server.site_files("site-0"), max_backoff_s=1).run(fit)
                server.wait(60)
            self.assertEqual(result.rounds_trained, 3)
            # Each round's arrays, a slice of one and a torch tensor over another still hold their values.
            for (weights, tail, bias), copy in zip(kept, copies):
                for name, array in weights.items():
                    np.testing.assert_array_equal(array, copy[name])
                np.testing.assert_array_equal(tail, copy["linear.weight"][0, 1:])
                np.testing.assert_array_equal(bias.numpy(), copy["linear.bias"])
            np.testing.assert_allclose(copies[2]["linear.bias"], [0.2 - 0.5], rtol=1e-6)


if __name__ == "__main__":
    unittest.main()
