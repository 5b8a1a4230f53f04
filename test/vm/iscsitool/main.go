// Command iscsitool drives packages lio (the target) and iscsi (the
// initiator) inside a test VM, whose kernel has the LIO target and the
// iSCSI initiator the host's lacks: the VM tests run it through the VM's
// agent.
//
//	iscsitool -prefix P -portal ADDR:PORT export NAME IMAGE SIZE SERIAL
//	iscsitool -prefix P -portal ADDR:PORT initiators NAME JSON   (a JSON list of lio.Initiator)
//	iscsitool -prefix P -portal ADDR:PORT show NAME              (prints the access list as JSON)
//	iscsitool -prefix P -portal ADDR:PORT unexport NAME
//	iscsitool [-replacement-timeout D] login JSON SERIAL         (an iscsi.Target; prints the iscsi.Disk as JSON)
//	iscsitool logout IQN ADDR:PORT
//	iscsitool sessions                                           (prints the kernel's sessions as JSON)
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"time"

	"github.com/modeguard/modeguard/pkg/backend/block/iscsi"
	"github.com/modeguard/modeguard/pkg/backend/block/lio"
)

func main() {
	root := flag.String("root", lio.DefaultRoot, "LIO's configfs directory")
	prefix := flag.String("prefix", "", "IQN prefix of the targets")
	portal := flag.String("portal", "", "address:port the targets listen on")
	replacement := flag.Duration("replacement-timeout", 0, "how long I/O waits for a lost session (0: open-iscsi's default)")
	flag.Parse()
	in := &iscsi.Initiator{ReplacementTimeout: *replacement}
	if err := run(in, *root, *prefix, *portal, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "iscsitool:", err)
		os.Exit(1)
	}
}

func run(in *iscsi.Initiator, root, prefix, portal string, args []string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out := json.NewEncoder(os.Stdout)
	switch {
	case len(args) == 0:
		return fmt.Errorf("want a command")
	case args[0] == "login" && len(args) == 3:
		var t iscsi.Target
		if err := json.Unmarshal([]byte(args[1]), &t); err != nil {
			return err
		}
		if err := in.Login(ctx, t); err != nil {
			return err
		}
		wait, stop := context.WithTimeout(ctx, 30*time.Second)
		defer stop()
		d, err := in.WaitDisk(wait, t.IQN, t.Portal, args[2])
		if err != nil {
			return err
		}
		return out.Encode(d)
	case args[0] == "logout" && len(args) == 3:
		ap, err := netip.ParseAddrPort(args[2])
		if err != nil {
			return err
		}
		return in.Logout(ctx, args[1], ap)
	case args[0] == "sessions" && len(args) == 1:
		list, err := in.Sessions()
		if err != nil {
			return err
		}
		return out.Encode(list)
	}
	return runTarget(root, prefix, portal, args, out)
}

func runTarget(root, prefix, portal string, args []string, out *json.Encoder) error {
	ap, err := netip.ParseAddrPort(portal)
	if err != nil {
		return err
	}
	t, err := lio.New(lio.Config{Root: root, Prefix: prefix, Portal: ap})
	if err != nil {
		return err
	}
	if len(args) < 2 {
		return fmt.Errorf("want a command and a volume name")
	}
	name := args[1]
	switch {
	case args[0] == "export" && len(args) == 5:
		size, err := strconv.ParseInt(args[3], 10, 64)
		if err != nil {
			return err
		}
		return t.Export(lio.LUN{Name: name, Image: args[2], Size: size, Serial: args[4]})
	case args[0] == "initiators" && len(args) == 3:
		var want []lio.Initiator
		if err := json.Unmarshal([]byte(args[2]), &want); err != nil {
			return err
		}
		return t.SetInitiators(name, want)
	case args[0] == "show" && len(args) == 2:
		have, err := t.Initiators(name)
		if err != nil {
			return err
		}
		return out.Encode(have)
	case args[0] == "unexport" && len(args) == 2:
		return t.Unexport(name)
	}
	return fmt.Errorf("unknown command %q with %d arguments", args[0], len(args)-1)
}
