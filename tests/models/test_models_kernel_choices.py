"""Row-invariant forms measured once per machine and read back on later starts (kernel_choices.py)."""

from __future__ import annotations

import json

import torch

from opentgi.models.layers import linear
from opentgi.models.layers.kernel_choices import KernelChoiceCache, machine_fingerprint


def test_a_form_measured_once_is_read_back_by_the_next_start(tmp_path, monkeypatch):
    calls = []

    def measure(out_features, in_features, dtype):
        calls.append((out_features, in_features, dtype))
        return 16

    monkeypatch.setattr(linear, "_invariant_tile", measure)
    first = KernelChoiceCache()
    first.attach(tmp_path, fingerprint="machine-a")
    monkeypatch.setattr(linear, "kernel_choices", first)
    assert linear.RowTiledLinear(torch.zeros(8, 4, dtype=torch.bfloat16)).tile == 16
    assert calls == [(8, 4, torch.bfloat16)]
    stored = json.loads((tmp_path / "measured" / "row-invariant-forms-machine-a.json").read_text())
    assert stored == {repr(("tiled", 8, 4, torch.bfloat16, "cpu")): 16}

    second = KernelChoiceCache()  # a new process on the same machine: nothing measured
    second.attach(tmp_path, fingerprint="machine-a")
    monkeypatch.setattr(linear, "kernel_choices", second)
    assert linear.RowTiledLinear(torch.zeros(8, 4, dtype=torch.bfloat16)).tile == 16
    assert linear.RowTiledLinear(torch.zeros(8, 4, dtype=torch.bfloat16)).tile == 16
    assert len(calls) == 1

    other = KernelChoiceCache()  # another CPU or torch: measured again
    other.attach(tmp_path, fingerprint="machine-b")
    monkeypatch.setattr(linear, "kernel_choices", other)
    linear.RowTiledLinear(torch.zeros(8, 4, dtype=torch.bfloat16))
    assert len(calls) == 2


def test_a_damaged_file_means_measuring_again(tmp_path):
    (tmp_path / "measured").mkdir()
    (tmp_path / "measured" / "row-invariant-forms-m.json").write_text("{not json")
    forms = KernelChoiceCache()
    forms.attach(tmp_path, fingerprint="m")
    assert (4, 4, torch.float32, False) not in forms
    forms[(4, 4, torch.float32, False)] = "padded"
    again = KernelChoiceCache()
    again.attach(tmp_path, fingerprint="m")
    assert (4, 4, torch.float32, False) in again and again[(4, 4, torch.float32, False)] == "padded"
    assert None not in again  # an unattached key stays absent


def test_the_fingerprint_follows_the_cpu_flags():
    a = "model name : X\nflags : avx2 avx512f\n"
    assert machine_fingerprint(a) == machine_fingerprint(a)
    assert machine_fingerprint(a) != machine_fingerprint("model name : X\nflags : avx2\n")
