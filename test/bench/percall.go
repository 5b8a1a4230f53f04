package main

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// perCallMethods are the calls whose cost must not grow with the number of
// volumes the driver holds.
var perCallMethods = []string{"CreateVolume", "ControllerPublishVolume", "NodePublishVolume"}

// perCall: one raw block volume's create, attach, stage and publish (and
// back) with few and with many volumes already recorded, one in a hundred
// of them attached to some other node. Each call's p50 and p99 at every
// count, and the ratio of the largest count's to the smallest's.
func perCall(ctx context.Context, b *bench) ([]row, error) {
	p, err := b.startBlockPair(ctx, "percall")
	if err != nil {
		return nil, err
	}
	c := capability(singleWriter, "")
	made := 0
	fill := func(total int) error {
		err := inBatches(made, total, func(i int) error {
			resp, err := p.ctrl.ctrl.CreateVolume(ctx, createReq(fmt.Sprintf("held-%d", i), scaleVolumeSize, c, nil))
			if err != nil {
				return fmt.Errorf("CreateVolume: %w", err)
			}
			if i%100 != 0 {
				return nil
			}
			node := fmt.Sprintf("bench-n%d@%s", i/100%50, zone)
			if _, err := p.ctrl.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
				VolumeId: resp.GetVolume().GetVolumeId(), NodeId: node, VolumeCapability: c}); err != nil {
				return fmt.Errorf("ControllerPublishVolume to %s: %w", node, err)
			}
			return nil
		})
		made = max(made, total)
		return err
	}
	samples := 40 * b.opts.runs
	at := map[int]map[string][]time.Duration{}
	for _, n := range b.opts.perCallCounts {
		if err := fill(n); err != nil {
			return nil, fmt.Errorf("recording %d volumes: %w", n, err)
		}
		p.steps = map[string][]time.Duration{}
		for i := range samples {
			name := fmt.Sprintf("timed-%d-%d", n, i)
			id, _, err := p.publish(ctx, name, scaleVolumeSize, c)
			if err != nil {
				return nil, fmt.Errorf("with %d volumes: %w", n, err)
			}
			if err := p.unpublish(ctx, name, id); err != nil {
				return nil, fmt.Errorf("with %d volumes: %w", n, err)
			}
		}
		at[n] = p.steps
		p.steps = nil
	}
	counts := b.opts.perCallCounts
	lo, hi := counts[0], counts[len(counts)-1]
	var rows []row
	for _, m := range perCallMethods {
		for _, n := range counts {
			med, spread := stats(at[n][m])
			rows = append(rows, row{name: fmt.Sprintf("%s with %d volumes recorded (raw block)", m, n),
				value: ms(med), spread: spread, note: fmt.Sprintf("p99 %s, %d samples", ms(p99(at[n][m])), len(at[n][m]))})
		}
		if lo != hi {
			rows = append(rows, growthRow(fmt.Sprintf("  %s at %d / at %d", m, hi, lo), at[lo][m], at[hi][m]))
		}
	}
	return rows, nil
}
