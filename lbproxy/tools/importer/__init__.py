"""`lbproxy import`: another balancer's configuration (HAProxy `mode tcp`, nginx
`stream`) as lbproxy's, with every directive not carried over named by FILE:LINE."""
