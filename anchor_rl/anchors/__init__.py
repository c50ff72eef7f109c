"""anchor_rl.anchors"""
