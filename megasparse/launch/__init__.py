"""``megasparse launch``: start training with Slurm, the DeepSpeed launcher, MPI or torchrun, after
checking the config against the number of processes (launch/*.py build the command lines)."""
