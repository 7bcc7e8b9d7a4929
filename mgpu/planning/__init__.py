"""Planning before loading: which devices exist (NVML), how big each component is (file headers), how much working
memory a workload needs, and where each component goes."""
