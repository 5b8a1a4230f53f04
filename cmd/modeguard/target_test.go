package main

import (
	"testing"
	"time"
)

func TestDialTimeoutGrowsToItsBound(t *testing.T) {
	for _, tc := range []struct {
		attempt int
		want    time.Duration
	}{
		{0, 10 * time.Second},
		{1, 20 * time.Second},
		{2, 40 * time.Second},
		{3, 60 * time.Second},
		{4, 60 * time.Second},
		{1000, 60 * time.Second},
	} {
		if got := dialTimeout(tc.attempt); got != tc.want {
			t.Errorf("dialTimeout(%d) = %v, want %v", tc.attempt, got, tc.want)
		}
	}
}
