"""Process discovery and setup: which launcher started us (launch_env.py) and the process groups (distributed.py)."""
