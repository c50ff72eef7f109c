"""anchor_rl.rewards"""
