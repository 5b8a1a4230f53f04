package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/modeguard/modeguard/pkg/localcluster"
	"github.com/modeguard/modeguard/pkg/stories"
)

// runDemo starts a controller and three node plugins in two zones from this
// very binary, walks them through the stories as a CO would, and prints
// every step: what was asked, what the driver answered, and why.
func runDemo(args []string) error {
	fs := flag.NewFlagSet("modeguard demo", flag.ContinueOnError)
	workDir := fs.String("work-dir", "", "where pools, state and logs go (default: a new directory under /var/tmp, removed afterwards)")
	keep := fs.Bool("keep", false, "keep the work dir (logs, pools) after the demo")
	verbosity := fs.Int("v", 0, "log verbosity of the driver processes")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: modeguard demo [flags] [story ...]\n\nStories: ")
		for _, s := range stories.All() {
			fmt.Fprintf(fs.Output(), "%s ", s.Name)
		}
		fmt.Fprintf(fs.Output(), "\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("the demo attaches loop devices and mounts filesystems: run it as root")
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	dir := *workDir
	if dir == "" {
		if dir, err = os.MkdirTemp("/var/tmp", "modeguard-demo-"); err != nil {
			return err
		}
		if !*keep {
			defer os.RemoveAll(dir)
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	fmt.Printf("modeguard demo: one controller and three node plugins (node-a1, node-a2 in zone-a; node-b1 in zone-b)\n")
	fmt.Printf("work dir %s; pools are sparse image files, volumes real loop devices and mounts\n", dir)
	cluster, err := localcluster.Start(ctx, self, dir, localcluster.DefaultNodes, *verbosity)
	if err != nil {
		return err
	}
	runErr := stories.Run(ctx, cluster.Stories, fs.Args()...)
	if leftovers := cluster.Stop(); len(leftovers) > 0 {
		fmt.Printf("\ncleanup had to force: %v\n", leftovers)
	}
	if *keep {
		fmt.Printf("\nlogs: %v\n", cluster.Logs())
	}
	if runErr != nil {
		return fmt.Errorf("a story did not go as told: %w", runErr)
	}
	fmt.Printf("\nEvery story held.\n")
	return nil
}
