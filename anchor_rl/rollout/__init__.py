"""anchor_rl.rollout"""
