"""estuary.Simulation: six sites as threads of this process against a real estuary-server.

The oracle (as e2e_custom_model_test's): each site takes one full-batch gradient step on its mean squared
error at the task's learning rate, and FedAvg weights the sites by their examples, so every round is one
step of gradient descent on all the sites' examples pooled, computed here in float64.
"""

import unittest

import numpy as np

import estuary

COUNTS = [10, 25, 40, 15, 30, 20]  # unequal: the weighting by examples matters
ROUNDS, LR = 3, 0.1


def site_data(k):
    rng = np.random.default_rng(100 + k)
    x = rng.normal(size=(COUNTS[k], 3))
    y = x @ np.array([2.0, -1.0, 0.5]) + 1 + 0.1 * rng.normal(size=COUNTS[k])
    return x, y


def gradient(w, b, x, y):
    error = x @ w + b - y
    return 2 * x.T @ error / len(y), 2 * error.mean(), (error ** 2).mean()


def make_fit(k):
    x, y = site_data(k)

    def fit(weights, config):
        w, b = weights["linear.weight"][0].astype(np.float64), float(weights["linear.bias"][0])
        gw, gb, loss = gradient(w, b, x, y)
        lr = config["learning_rate"]
        return ({"linear.weight": (w - lr * gw)[None, :], "linear.bias": np.array([b - lr * gb])}, len(y),
                {"loss": loss})

    return estuary.Site(fit, num_examples=len(y))


class SimulationTest(unittest.TestCase):
    def test_fedavg_of_one_step_sites_is_gradient_descent_on_the_pooled_data(self):
        initial = {"linear.weight": np.array([[0.5, -0.25, 0.125]], np.float32),
                   "linear.bias": np.array([0.2], np.float32)}
        sim = estuary.Simulation(initial, [make_fit(k) for k in range(len(COUNTS))], rounds=ROUNDS,
                                 learning_rate=LR, round_deadline_s=60)
        result = sim.run(timeout_s=300)

        x = np.concatenate([site_data(k)[0] for k in range(len(COUNTS))])
        y = np.concatenate([site_data(k)[1] for k in range(len(COUNTS))])
        w, b = initial["linear.weight"][0].astype(np.float64), float(initial["linear.bias"][0])
        for _ in range(ROUNDS):
            gw, gb, _ = gradient(w, b, x, y)
            lr = float(np.float32(LR))  # the task carries it as fp32
            w, b = w - lr * gw, b - lr * gb
        np.testing.assert_allclose(result.model["linear.weight"][0], w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result.model["linear.bias"], [b], rtol=1e-5, atol=1e-6)
        self.assertGreater(abs(result.model["linear.bias"][0] - 0.2), 0.1)  # it moved

        self.assertEqual([r.rounds_trained for r in result.sites], [ROUNDS] * len(COUNTS))
        self.assertEqual([r.failures for r in result.sites], [[]] * len(COUNTS))
        self.assertEqual([r["round"] for r in result.rounds], list(range(1, ROUNDS + 1)))
        self.assertEqual({r["updates_received"] for r in result.rounds}, {len(COUNTS)})
        losses = [r["train_loss"] for r in result.rounds]
        self.assertLess(losses[-1], losses[0])  # the sites' reported loss falls
        self.assertFalse(result.workdir.exists())  # a temporary scratch directory is removed

    def test_a_server_that_cannot_start_is_one_error(self):
        sim = estuary.Simulation({"w": np.zeros(2, np.float32)}, [make_fit(0)], rounds=1,
                                 server_flags=["--update-kind", "lora"])
        with self.assertRaises(estuary.SimulationError) as caught:
            sim.run(timeout_s=60)
        self.assertIn("lora", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
