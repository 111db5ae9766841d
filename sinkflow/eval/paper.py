"""The numbers we compare against, copied from arXiv:2401.14069v1 (benchmarks/RESULTS.md puts ours beside them)."""

# Table 1: W2 on 1024 test samples, NSGF row, {task: {euler_steps: w2}}
TABLE1_NSGF = {
    "8gaussians": {10: 0.285, 100: 0.278},
    "8gaussians-moons": {10: 0.144, 100: 0.144},
    "moons": {10: 0.077, 100: 0.067},
    "scurve": {10: 0.117, 100: 0.110},
    "checkerboard": {10: 0.252, 100: 0.147},
}
TABLE1_OTCFM = {
    "8gaussians": {10: 0.289, 100: 0.269},
    "8gaussians-moons": {10: 0.173, 100: 0.165},
    "moons": {10: 0.088, 100: 0.078},
    "scurve": {10: 0.149, 100: 0.127},
    "checkerboard": {10: 0.253, 100: 0.159},
}
TABLE1_FM = {
    "8gaussians": {10: 0.423, 100: 0.415},
    "8gaussians-moons": {10: 0.292, 100: 0.290},
    "moons": {10: 0.111, 100: 0.097},
    "scurve": {10: 0.171, 100: 0.135},
    "checkerboard": {10: 0.417, 100: 0.165},
}
TABLE1 = {"nsgf": TABLE1_NSGF, "otcfm": TABLE1_OTCFM, "fm": TABLE1_FM}

# Table 3 (MNIST) and Table 2 (CIFAR-10): NSGF++ FID at NFE
TABLE3_MNIST = {"fid": 3.8, "nfe": 60}
TABLE2_CIFAR10 = {"fid": 5.55, "is": 8.86, "nfe": 59}


def paper_w2(method: str, task: str, steps: int) -> float | None:
    return TABLE1.get(method, {}).get(task, {}).get(steps)
