"""Run configs shipped with megasparse: `megasparse train NAME` finds configs/NAME.yaml."""
