"""anchor_rl.trainer"""
