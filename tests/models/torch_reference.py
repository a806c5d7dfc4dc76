#!/usr/bin/python3
"""Writes PyTorch reference values for tests/models: layer, loss and optimizer
outputs and gradients for fixed seeded inputs, and one whole SGD step of each
model. Usage: torch_reference.py OUT_DIR. Each case is a JSON file of named
flat float lists (row-major, PyTorch layouts)."""
import json
import os
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # fail loudly: these tests are the numerics oracle
    sys.exit(f"torch_reference.py: PyTorch is required (Debian package python3-torch): {e}")

torch.manual_seed(1234)
torch.set_default_dtype(torch.float32)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import CNN, MLP  # noqa: E402

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)


def flat(t):
    return [float(v) for v in t.detach().reshape(-1).tolist()]


def save(name, **tensors):
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({k: flat(v) if torch.is_tensor(v) else v for k, v in tensors.items()}, f)


def rand(*shape):
    return (torch.rand(*shape) * 2 - 1).requires_grad_()


# Linear: y = x W^T + b, with an upstream gradient dy.
x, w, b = rand(7, 13), rand(5, 13), rand(5)
y = F.linear(x, w, b)
dy = torch.randn_like(y)
y.backward(dy)
save("linear", x=x, w=w, b=b, y=y, dy=dy, dx=x.grad, dw=w.grad, db=b.grad)

# ReLU.
x = rand(6, 11)
y = F.relu(x)
dy = torch.randn_like(y)
y.backward(dy)
save("relu", x=x, y=y, dy=dy, dx=x.grad)

# Conv2d 5x5, padding 2, on [n, c, h, w].
x, w, b = rand(2, 3, 8, 8), rand(4, 3, 5, 5), rand(4)
y = F.conv2d(x, w, b, padding=2)
dy = torch.randn_like(y)
y.backward(dy)
save("conv2d", x=x, w=w, b=b, y=y, dy=dy, dx=x.grad, dw=w.grad, db=b.grad)

# MaxPool 2x2.
x = rand(2, 3, 6, 6)
y = F.max_pool2d(x, 2)
dy = torch.randn_like(y)
y.backward(dy)
save("maxpool", x=x, y=y, dy=dy, dx=x.grad)

# Softmax cross-entropy, mean over the batch.
z = (torch.randn(9, 10) * 3).requires_grad_()
labels = torch.randint(0, 10, (9,))
loss = F.cross_entropy(z, labels)
loss.backward()
save("cross_entropy", z=z, labels=[int(v) for v in labels], loss=[float(loss)], dz=z.grad)

# SGD with momentum and weight decay, three steps with fixed gradients.
p = torch.randn(50).requires_grad_()
start = p.detach().clone()
grads = [torch.randn(50) for _ in range(3)]
opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=1e-3)
for g in grads:
    p.grad = g.clone()
    opt.step()
save("sgd", start=start, g0=grads[0], g1=grads[1], g2=grads[2], result=p)

# AdamW with weight decay, five steps with fixed gradients (bias corrections
# differ every step, so each step is checked by the next).
p = torch.randn(64).requires_grad_()
start = p.detach().clone()
grads = [torch.randn(64) * (0.1 + i) for i in range(5)]
opt = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
for g in grads:
    p.grad = g.clone()
    opt.step()
save("adamw", start=start, result=p, exp_avg=opt.state[p]["exp_avg"], exp_avg_sq=opt.state[p]["exp_avg_sq"],
     **{f"g{i}": g for i, g in enumerate(grads)})

# clip_grad_norm_ over several tensors; one case clips, one does not.
for name, max_norm in (("clip", 0.5), ("noclip", 1e6)):
    ts = [torch.randn(17).requires_grad_(), torch.randn(4, 5).requires_grad_()]
    for t in ts:
        t.grad = torch.randn_like(t)
    before = torch.cat([t.grad.reshape(-1) for t in ts]).clone()
    norm = torch.nn.utils.clip_grad_norm_(ts, max_norm)
    save(name, before=before, after=torch.cat([t.grad.reshape(-1) for t in ts]), norm=[float(norm)],
         max_norm=[max_norm])


# One whole training step of each model: forward, loss, backward, SGD step;
# with momentum (the separate optimizer) and without (the fused path).
for name, model, momentum in (("mlp", MLP(), 0.9), ("cnn", CNN(), 0.9), ("mlp_plain", MLP(), 0.0),
                              ("cnn_plain", CNN(), 0.0)):
    x = torch.rand(10, 784)
    labels = torch.randint(0, 10, (10,))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum, weight_decay=1e-4)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), labels)
    loss.backward()
    grads = {k + ".grad": p.grad.detach().clone() for k, p in model.named_parameters()}
    opt.step()
    after = {k + ".after": v for k, v in model.state_dict().items()}
    save("step_" + name, x=x, labels=[int(v) for v in labels], loss=[float(loss)], **before, **grads, **after)

# FedProx (Li et al. 2020): three local steps of the MLP on
# cross-entropy + mu/2 ||w - w0||^2, w0 the round's starting weights, the
# gradient clipped to norm 1 after the proximal term (as clip_grad_norm_
# after backward does), then SGD with momentum and weight decay.
model, mu = MLP(), 5.0
with torch.no_grad():
    for p in model.parameters():
        p.mul_(4)  # large enough weights that the clip and the proximal term both matter
before = {k: v.detach().clone() for k, v in model.state_dict().items()}
anchor = [p.detach().clone() for p in model.parameters()]
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-4)
batches = {}
norms = []
for step in range(3):
    x = torch.rand(10, 784)
    labels = torch.randint(0, 10, (10,))
    batches[f"x{step}"] = x
    batches[f"labels{step}"] = [int(v) for v in labels]
    opt.zero_grad()
    loss = F.cross_entropy(model(x), labels)
    loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
    loss.backward()
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
    opt.step()
after = {k + ".after": v for k, v in model.state_dict().items()}
save("fedprox_mlp", mu=[mu], max_norm=[1.0], lr=[0.5], norms=norms, **batches, **before, **after)

# The CNN's second convolution (32 -> 64 channels on 14x14, the products the
# CPU layer runs per image on libxsmm) with its ReLU, then one plain SGD step.
x, w, b = rand(2, 32, 14, 14), (rand(64, 32, 5, 5) * 0.05).detach().requires_grad_(), rand(64)
y = F.relu(F.conv2d(x, w, b, padding=2))
dy = torch.randn_like(y)
y.backward(dy)
w_before, b_before = w.detach().clone(), b.detach().clone()
sgd = torch.optim.SGD([w, b], lr=0.05, weight_decay=1e-4)
sgd.step()
save("conv2d_relu_sgd", x=x, w=w_before, b=b_before, y=y, dy=dy, dx=x.grad, w_after=w, b_after=b)
