"""Reads real GPU telemetry through NVML, writes it as dcgm-exporter's Prometheus page (the
same DCGM field names, units and labels), idle and under a bf16 matrix-multiply load, and
runs `sluice telemetry dcgm` on both pages: the check that Sluice's extractor reads a real
accelerator's numbers. Run by tests/gpu/run.sh on a machine with an NVIDIA GPU; dcgm-exporter
itself need not be installed."""

import os
import socket
import subprocess
import sys
import threading
import time

import pynvml

OUT = os.environ.get("OUT", "/tmp/sluice-gpu")
SLUICE = sys.argv[1]

# (DCGM field, TYPE, HELP) as dcgm-exporter's default counters publish them.
FIELDS = [
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Frame buffer memory free (in MB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Frame buffer memory used (in MB)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge", "Current clock event reasons (bitmask)."),
]


def read(h):
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    try:
        reasons = pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
    except AttributeError:
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
    return {
        "DCGM_FI_DEV_GPU_UTIL": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
        "DCGM_FI_DEV_FB_FREE": mem.free // (1 << 20),
        "DCGM_FI_DEV_FB_USED": mem.used // (1 << 20),
        "DCGM_FI_DEV_GPU_TEMP": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        "DCGM_FI_DEV_POWER_USAGE": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": reasons,
    }


def page():
    host = socket.gethostname()
    driver = pynvml.nvmlSystemGetDriverVersion()
    gpus = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        labels = (
            f'gpu="{i}",UUID="{pynvml.nvmlDeviceGetUUID(h)}",'
            f'pci_bus_id="{pynvml.nvmlDeviceGetPciInfo(h).busId}",device="nvidia{i}",'
            f'modelName="{pynvml.nvmlDeviceGetName(h)}",Hostname="{host}",'
            f'DCGM_FI_DRIVER_VERSION="{driver}"'
        )
        gpus.append((labels, read(h)))
    lines = []
    for name, kind, help_ in FIELDS:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, values in gpus:
            lines.append(f"{name}{{{labels}}} {values[name]}")
    return "\n".join(lines) + "\n"


def sluice(path):
    r = subprocess.run(
        [SLUICE, "--json", "telemetry", "dcgm", path], capture_output=True, text=True
    )
    return r.returncode, r.stdout + r.stderr


def load(seconds):
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()


def main():
    os.makedirs(OUT, exist_ok=True)
    pynvml.nvmlInit()
    results = {}
    with open(f"{OUT}/idle.prom", "w") as f:
        f.write(page())
    t = threading.Thread(target=load, args=(12,))
    t.start()
    time.sleep(7)  # NVML's utilisation is averaged over its last sample period
    with open(f"{OUT}/load.prom", "w") as f:
        f.write(page())
    t.join()
    for phase in ("idle", "load"):
        rc, text = sluice(f"{OUT}/{phase}.prom")
        results[phase] = (rc, text)
        with open(f"{OUT}/{phase}.sluice.json", "w") as f:
            f.write(text)
        print(f"== {phase}: sluice telemetry dcgm exit {rc}\n{text}")
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,utilization.gpu,memory.used,memory.free,temperature.gpu,power.draw",
         "--format=csv"],
        capture_output=True, text=True,
    ).stdout
    with open(f"{OUT}/nvidia-smi.csv", "w") as f:
        f.write(smi)
    print(smi)
    ok = all(rc == 0 for rc, _ in results.values())
    sys.exit(0 if ok else 1)


main()
