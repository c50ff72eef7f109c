"""anchor_rl.algos"""
