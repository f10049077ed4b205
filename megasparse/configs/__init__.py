"""Run configs shipped with megasparse: `megasparse train NAME` finds megasparse/configs/NAME.yaml."""
